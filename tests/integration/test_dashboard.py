"""The dashboard in headless Chromium (Debian's chromium), against a live
zcoord. With a finished job (--dump-dom): the loss and LR charts are drawn
with one point per step, the workers table has a row per worker, the
logbook is filled. Watching a run (one page over the DevTools protocol,
cdp.py): the page refreshes itself while the job runs and stops when it
ends, picks jobs from a list (newest first) and from the URL hash, draws
validation loss, grad norm and tokens/s, marks a rollback with its reason,
and shows the newest committed checkpoint. Works offline: Chart.js comes
from Debian's libjs-chart.js via zcoord. Screenshots are saved next to the
tests' logs."""
import os
import re
import shutil
import subprocess

import pytest

from cdp import Browser
from ztest import (SLOW, byte_dataset, events, http_get, job, start_fleet, submit, tiny_spec,
                   wait_job, wait_until, zctl)

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
    cks = http_get(coord.http_port, f"/v1/jobs/{jid}/checkpoints")[2]["checkpoints"]
    assert ck_rows.count("<tr>") == 1 + len(cks) and len(cks) >= 3, ck_rows  # 10, 20, 30, ...
    assert "committed" in ck_rows
    newest = max(c["step"] for c in cks if c["state"] == "committed")
    assert f'data-checkpoint-step="{newest}"' in dom
    assert f"newest committed checkpoint: step {newest}" in dom
    assert 'data-live="0"' in dom  # the job has ended: the page stopped polling
    shot = os.path.join(procs.tmp, "dashboard.png")
    r = chrome(url, f"--screenshot={shot}", "--window-size=1280,1000")
    assert os.path.getsize(shot) > 10_000, r.stderr[-2000:]


def jobinfo(b):
    """The picked job as the page shows it: #jobinfo's data- attributes."""
    return b.eval("Object.assign({}, document.getElementById('jobinfo').dataset)")


def canvas_counts(b):
    return b.eval("Object.fromEntries([...document.querySelectorAll('canvas')]"
                  ".map((c) => [c.id, Object.assign({}, c.dataset)]))")


def shown(b, jid, pred=lambda d: True):
    """A poll for wait_until: #jobinfo once it shows job jid and pred holds."""
    def check():
        d = jobinfo(b)
        return d if d.get("job") == str(jid) and pred(d) else None
    return check


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
def test_dashboard_watches_a_run(procs, tmp_path):
    train, val = byte_dataset(str(tmp_path / "data"), 150_000)
    coord = start_fleet(procs, 2, prefix="d", timeout_ms=None)
    first = submit(coord, tiny_spec(train, val, 20, workers=2, eval={"every_steps": 5, "batches": 1},
                                    checkpoint={"dir": str(tmp_path / "ck1"), "every_steps": 10}),
                   tmp_path, "first.json")
    wait_job(coord, first)
    # The second job is far too long to finish: the test cancels it.
    second = submit(coord, tiny_spec(train, val, 100_000, workers=2,
                                     eval={"every_steps": 10, "batches": 1},
                                     checkpoint={"dir": str(tmp_path / "ck2"), "every_steps": 10,
                                                 "keep_last": 1000}),
                    tmp_path, "second.json")
    wait_until(lambda: job(coord, second)["step"] > 0, 30, "the second job training")
    url = f"http://127.0.0.1:{coord.http_port}/"
    b = Browser(os.path.join(procs.tmp, "chromium.log"))
    try:
        b.navigate(url)
        # No hash: the newest job, live. The same page then shows newer
        # steps by itself (it polls; nothing reloads it).
        d = wait_until(shown(b, second, lambda d: int(d.get("step", 0)) > 0), 30 * SLOW,
                       "the page showing the running job")
        assert d["live"] == "1" and d["state"] == "running", d
        step1 = int(d["step"])
        d = wait_until(shown(b, second, lambda d: int(d["step"]) > step1), 30 * SLOW,
                       f"the page showing a step after {step1} without a reload")
        # The picker lists both jobs, newest first, the shown one selected.
        assert b.eval("[...document.querySelectorAll('#job-picker option')].map((o) => o.value)") \
            == [str(second), str(first)]
        assert b.eval("document.getElementById('job-picker').value") == str(second)
        # Validation loss next to training loss, grad norm and tokens/s.
        c = wait_until(lambda: (lambda c: c if int(c["loss"].get("valPoints", 0)) >= 1 else None)(
            canvas_counts(b)), 30 * SLOW, "validation loss points")
        for name in ("loss", "lr", "gradnorm", "tokens"):
            assert int(c[name]["points"]) >= 1, c
        assert int(c["loss"]["points"]) > int(c["loss"]["valPoints"])
        # The newest committed checkpoint, as the API says.
        d = wait_until(shown(b, second, lambda d: int(d["checkpointStep"]) >= 10), 30 * SLOW,
                       "a committed checkpoint shown")
        cks = http_get(coord.http_port, f"/v1/jobs/{second}/checkpoints")[2]["checkpoints"]
        assert int(d["checkpointStep"]) in [k["step"] for k in cks if k["state"] != "pending"]
        # An operator rollback to before steps the page has drawn: a marker
        # at the step it went back to, its reason in the title (the hover
        # text) and in the chart's data.
        d = wait_until(shown(b, second, lambda d: int(d["step"]) >= 40), 30 * SLOW, "step 40")
        to = int(d["step"]) - 15
        now = job(coord, second)["step"]
        zctl(coord.grpc, "rollback", str(second), "--to-step", str(to))
        rb = [e for e in events(coord, job=second) if e["kind"] == "rollback"]
        assert len(rb) == 1 and "operator rollback" in rb[0]["detail"], rb
        target = int(re.search(r"\(step (\d+)\)$", rb[0]["detail"]).group(1))
        assert 0 < target <= to, rb
        mark = wait_until(lambda: b.eval(
            f"(() => {{ const li = document.querySelector('#markers li[data-step=\"{target}\"]');"
            " return li && {kinds: li.dataset.kinds, title: li.title}; })()"), 30 * SLOW,
            f"a marker at step {target}")
        assert "rollback" in mark["kinds"] and "generation_started" in mark["kinds"], mark
        assert f"operator rollback to step {to}" in mark["title"], mark
        assert f"reason: rollback to step {target}" in mark["title"], mark
        assert int(canvas_counts(b)["loss"]["marks"]) >= 1
        # Hovering the marker on the loss chart shows the reason. The chart
        # redraws as steps arrive, so the pointer is moved to the marker's
        # current place until the tooltip is the marker's (bounded).
        def hover_tip():
            x, y = b.eval("(() => { const c = Chart.getChart('loss'),"
                          " p = c.getDatasetMeta(2).data[0]; c.canvas.scrollIntoView();"
                          " const r = c.canvas.getBoundingClientRect();"
                          " return [r.left + p.x, r.top + p.y]; })()")
            b.call("Input.dispatchMouseEvent", session=True, type="mouseMoved", x=x, y=y)
            tip = b.eval("(Chart.getChart('loss').tooltip.body || []).flatMap((l) => l.lines)"
                         ".join(' | ')")
            return tip if f"operator rollback to step {to}" in tip else None

        wait_until(hover_tip, 10 * SLOW, "the rollback marker's tooltip")
        shot = os.path.join(procs.tmp, "dashboard-live.png")
        b.screenshot(shot)
        with open(shot, "rb") as f:
            png = f.read()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, len(png)
        # The replay passes the step of the rollback (the page fetches the
        # replayed steps' new records as they come); then the job ends: the
        # page says so and stops polling.
        wait_until(shown(b, second, lambda d: int(d["step"]) > now + 10), 30 * SLOW,
                   f"the page showing step {now + 10} replayed")
        zctl(coord.grpc, "cancel", str(second))
        wait_until(shown(b, second, lambda d: d["state"] == "canceled" and d["live"] == "0"),
                   30 * SLOW, "the page showing the job canceled, not live")
        # What the page drew, fetched piecemeal across the rollback (the
        # replayed steps replaced their records), is the API's whole series.
        # (A long series is decimated for drawing: Chart.js then keeps the
        # series it was given in _data.)
        drawn = b.eval("(() => { const d = Chart.getChart('loss').data.datasets[0];"
                       " return (d._data || d.data).map((p) => [p.x, p.y]); })()")
        api = http_get(coord.http_port, f"/v1/jobs/{second}/metrics")[2]["steps"]
        assert drawn == [[s["step"], s["loss"]] for s in api]
        assert {s["generation"] for s in api} == {1, 2}
        # Picking the other job through the URL hash, then loading the page
        # afresh with that hash: its id and its data.
        b.eval(f"location.hash = 'job={first}'")
        for attempt in ("hash change", "fresh load"):
            d = wait_until(shown(b, first, lambda d: d["state"] == "completed"), 30 * SLOW,
                           f"job {first} shown after a {attempt}")
            assert d["step"] == "20" and d["live"] == "0", d
            assert b.eval("document.getElementById('job-picker').value") == str(first)
            c = canvas_counts(b)
            assert c["loss"]["points"] == "20" and c["loss"]["valPoints"] == "4", c
            assert c["loss"]["marks"] == "0"
            dom = b.dom()
            assert f"Job <span id=\"jobname\">{first}: tiny-s0-n2</span>" in dom
            b.navigate("about:blank")
            b.navigate(url + f"#job={first}")
    finally:
        b.close()
