"""The dashboard in headless Chromium (Debian's chromium), against a live
zcoord with a finished job: the loss and LR charts are drawn with one point
per step, the workers table has a row per worker, the logbook is filled.
Works offline: Chart.js comes from Debian's libjs-chart.js via zcoord.
A screenshot is saved next to the test's logs."""
import os
import re
import shutil
import subprocess

import pytest

from ztest import SLOW, byte_dataset, start_fleet, submit, tiny_spec, wait_job

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chrome(url, *extra):
    return subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                           "--disable-dev-shm-usage", "--virtual-time-budget=8000",
                           *extra, url], capture_output=True, text=True, timeout=120 * SLOW)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_dashboard_draws_the_run(procs, tmp_path):
    train, val = byte_dataset(str(tmp_path / "data"), 150_000)
    coord = start_fleet(procs, 2, prefix="d", timeout_ms=None)
    jid = submit(coord, tiny_spec(train, val, 40, stage=2, workers=2,
                                  checkpoint={"dir": str(tmp_path / "ck"), "every_steps": 10}),
                 tmp_path)
    wait_job(coord, jid)
    url = f"http://127.0.0.1:{coord.http_port}/"
    r = chrome(url, "--dump-dom")
    dom = r.stdout
    assert 'data-ready="1"' in dom, r.stderr[-2000:]
    m = re.search(r'<canvas id="loss"[^>]*data-points="(\d+)"', dom)
    assert m and int(m.group(1)) == 40, dom[:2000]
    m = re.search(r'<canvas id="lr"[^>]*data-points="(\d+)"', dom)
    assert m and int(m.group(1)) == 40
    workers_tbody = dom.split('<table id="workers">')[1].split("</table>")[0]
    assert workers_tbody.count("<tr>") == 1 + 2  # header + two workers
    assert "d0" in workers_tbody and "state-alive" in workers_tbody
    assert "job_completed" in dom and "completed" in dom
    ck_rows = dom.split('<table id="checkpoints">')[1].split("</table>")[0]
    assert ck_rows.count("<tr>") == 1 + 3 and "committed" in ck_rows  # steps 10, 20, 30
    shot = os.path.join(procs.tmp, "dashboard.png")
    r = chrome(url, f"--screenshot={shot}", "--window-size=1280,1000")
    assert os.path.getsize(shot) > 10_000, r.stderr[-2000:]
