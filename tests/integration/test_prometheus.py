"""Monitoring with Debian's real Prometheus (deploy/prometheus/).

The shipped alert rules pass `promtool check rules` and their unit tests
(`promtool test rules`); the example configuration passes `promtool check
config`. Then a real prometheus process scrapes a live zcoord (1 s
interval, the shipped rules evaluated every second): a job's series are
read back through Prometheus's own HTTP API, and killing the worker makes
the shipped ZtrainWorkerLost alert fire there.
"""
import json
import os
import shutil
import subprocess
import urllib.parse

from ztest import (SRC, byte_dataset, free_port, http_get, start_fleet, submit, tiny_spec,
                   wait_job, wait_until)

import pytest

RULES = os.path.join(SRC, "deploy", "prometheus")


def tool(name):
    path = shutil.which(name)
    assert path, f"{name} is not installed: deploy/install-deps.sh installs Debian's prometheus"
    return path


def test_shipped_rules_and_config_check_and_pass_their_unit_tests():
    for args, says in ((["check", "rules", "ztrain-alerts.yml"], "SUCCESS: 7 rules found"),
                       (["check", "config", "prometheus.yml"], "SUCCESS"),
                       (["test", "rules", "ztrain-alerts.test.yml"], "SUCCESS")):
        r = subprocess.run([tool("promtool"), *args], cwd=RULES, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        assert says in r.stdout, (args, r.stdout)


@pytest.fixture
def prometheus(procs, tmp_path):
    """Starts prometheus on a free port; returns (proc, port, write_config)."""
    port = free_port()
    cfg = tmp_path / "prometheus.yml"

    def start(target):
        cfg.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [os.path.join(RULES, "ztrain-alerts.yml")],
            "scrape_configs": [{"job_name": "zcoord",
                                "static_configs": [{"targets": [target]}]}]}))
        p = procs.start("prometheus", [
            tool("prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"])
        wait_until(lambda: p.alive() and http_get(port, "/-/ready")[0] == 200, 30,
                   "prometheus ready")
        return p
    return port, start


def query(port, expr):
    q = urllib.parse.quote(expr)
    status, _, body = http_get(port, f"/api/v1/query?query={q}")
    assert status == 200 and body["status"] == "success", body
    return {tuple(sorted(r["metric"].items())): float(r["value"][1])
            for r in body["data"]["result"]}


def test_prometheus_scrapes_zcoord_and_fires_worker_lost(procs, tmp_path, prometheus):
    port, start = prometheus
    data = byte_dataset(str(tmp_path / "data"), limit=100_000)
    coord = start_fleet(procs, 1, hb_ms=200, timeout_ms=1500)
    p = start(f"127.0.0.1:{coord.http_port}")
    wait_until(lambda: query(port, 'up{job="zcoord"}') and
               list(query(port, 'ztrain_workers{state="alive"}').values()) == [1.0], 30,
               "zcoord's series in prometheus")
    train, val = data
    jid = submit(coord, tiny_spec(train, val, 40, checkpoint={"dir": str(tmp_path / "ck"),
                                                              "every_steps": 20}), tmp_path)
    wait_job(coord, jid)
    sel = f'{{job="zcoord", job_id="{jid}"}}'
    wait_until(lambda: list(query(port, f"ztrain_job_steps_total{sel}").values()) == [40.0],
               30, "the job's steps in prometheus")
    stamp = list(query(port, f"ztrain_job_last_checkpoint_timestamp_seconds{sel}").values())
    assert stamp and stamp[0] > 1.7e9, stamp
    assert list(query(port, f"ztrain_job_active{sel}").values()) == [0.0]
    assert not [a for a in http_get(port, "/api/v1/alerts")[2]["data"]["alerts"]
                if a["state"] == "firing"]
    coord.workers["w0"].kill()

    def lost_alert():
        alerts = http_get(port, "/api/v1/alerts")[2]["data"]["alerts"]
        return [a for a in alerts if a["labels"]["alertname"] == "ZtrainWorkerLost"
                and a["state"] == "firing"]
    fired = wait_until(lost_alert, 30, "ZtrainWorkerLost firing in prometheus")
    assert fired[0]["annotations"]["summary"] == "1 ztrain worker(s) lost", fired
    assert p.alive()
