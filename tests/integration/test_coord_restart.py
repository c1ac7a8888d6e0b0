"""A restart of zcoord costs no generation.

zcoord is stopped (SIGTERM, or SIGKILL as a crash would) while its workers
are busy training, and started again on the same database and ports. The
workers' retries while it is away are capped near the heartbeat interval,
and the restarted coordinator gives the members it believes alive a grace
period based on that, so every member reconnects in time: the generation
goes on, nobody is declared lost, and the losses equal an uninterrupted
run's. Real processes; each case restarts the coordinator four times.
"""
import json
import signal
import sqlite3
import urllib.error
import urllib.request

import pytest

from ztest import (byte_dataset, events, job, losses, start_fleet, submit, tiny_spec, wait_job,
                   wait_until, workers_by_name, zctl)

HB, TIMEOUT = 300, 3000
STEPS = 1500


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=200_000)


def generations(db, jid):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT COUNT(*) FROM generations WHERE job_id = ?", (jid,)).fetchone()[0]


@pytest.mark.parametrize("how", ["term", "kill"])
def test_restart_with_busy_workers_keeps_the_generation(procs, tmp_path, data, how):
    train, val = data
    coord = start_fleet(procs, 3, hb_ms=HB, timeout_ms=TIMEOUT)
    spec = tiny_spec(train, val, STEPS, stage=1, workers=3,
                     checkpoint={"dir": str(tmp_path / "ck"), "every_steps": 25})
    ref = submit(coord, tiny_spec(train, val, STEPS, stage=1, workers=3), tmp_path, "ref.json")
    wait_job(coord, ref, timeout=300)
    jid = submit(coord, spec, tmp_path)
    wait_until(lambda: job(coord, jid)["step"] >= 10, 60, "training under way")
    db, names = coord.db, list(coord.workers)
    for i in range(4):
        j = job(coord, jid)
        assert j["state"] == "running", ("make the job longer", j)
        step = j["step"]
        if how == "term":
            coord.signal(signal.SIGTERM)
            coord.wait(10)
        else:
            coord.kill()
        coord = procs.coord(db=db, hb_ms=HB, timeout_ms=TIMEOUT, name=f"zcoord{i + 2}",
                            grpc_port=coord.grpc_port, http_port=coord.http_port)
        # Training goes on under the new coordinator...
        wait_until(lambda: job(coord, jid)["step"] >= step + 15, 60, "steps after the restart")
        # ...in the same generation, with every worker alive.
        assert generations(db, jid) == 1
        assert all(workers_by_name(coord)[n]["state"] == "alive" for n in names)
    j = wait_job(coord, jid, timeout=300)
    assert j["generation"] == 1 and j["restarts"] == 0
    kinds = [e["kind"] for e in events(coord)]
    assert "lost" not in kinds and "rank_failed" not in kinds, kinds
    assert kinds.count("coordinator_started") == 5
    assert losses(coord, jid) == losses(coord, ref)


def post(coord, path):
    req = urllib.request.Request(f"http://127.0.0.1:{coord.http_port}{path}", data=b"",
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_stored_spec_refused_after_restart_fails_its_job(procs, tmp_path, data):
    """Jobs submitted with a test knob (fault_injection, accepted under
    --allow-test-knobs), then zcoord restarted without the flag: their specs
    no longer pass its checks. They fail with the reason, in memory and in
    the database, cannot be resumed, and zcoord stays up and runs the other
    jobs."""
    train, val = data
    coord = procs.coord(hb_ms=HB, timeout_ms=TIMEOUT)  # --allow-test-knobs
    knob = {"lr_scale": 1.0, "from_step": 2}
    pending = submit(coord, tiny_spec(train, val, 5, fault_injection=knob), tmp_path, "a.json")
    paused = submit(coord, tiny_spec(train, val, 5, fault_injection=knob), tmp_path, "b.json")
    zctl(coord.grpc, "pause", str(paused))
    plain = submit(coord, tiny_spec(train, val, 5), tmp_path, "c.json")
    coord.signal(signal.SIGTERM)
    coord.wait(10)
    coord = procs.coord(db=coord.db, hb_ms=HB, timeout_ms=TIMEOUT, name="zcoord2",
                        test_knobs=False)
    for jid in (pending, paused):
        j = job(coord, jid)
        assert j["state"] == "failed", j
        assert j["message"].startswith("stored spec invalid: fault_injection"), j
        assert "--allow-test-knobs" in j["message"], j
    # Resuming one is refused, saying why.
    code, body = post(coord, f"/v1/jobs/{paused}/resume")
    assert code == 409 and "cannot be resumed: stored spec invalid" in body["error"], body
    r = zctl(coord.grpc, "resume", str(paused), check=False)
    assert r.returncode == 1 and "stored spec invalid: fault_injection" in r.stderr, r.stderr
    # The other job runs once a worker comes, and zcoord stays up.
    procs.worker(coord.grpc, "w0", extra=["--threads", "1"])
    assert wait_job(coord, plain, timeout=120)["state"] == "completed"
    assert coord.alive()
    assert [job(coord, jid)["state"] for jid in (pending, paused)] == ["failed", "failed"]
    # The database agrees, and the logbook says why.
    with sqlite3.connect(coord.db) as db:
        stored = dict(db.execute("SELECT id, message FROM jobs WHERE id IN (?, ?)",
                                 (pending, paused)).fetchall())
    assert all(m.startswith("stored spec invalid") for m in stored.values()), stored
    failed = [e for e in events(coord, job=pending) if e["kind"] == "job_failed"]
    assert len(failed) == 1 and "fault_injection" in failed[0]["detail"], failed


def test_worker_backs_off_and_counts_while_the_coordinator_is_away(procs, tmp_path):
    """With zcoord gone, a worker retries with backoff and logs the first
    failure and then every 20th with its count: not a line per attempt."""
    coord = start_fleet(procs, 1, hb_ms=HB, timeout_ms=TIMEOUT)
    w = coord.workers["w0"]
    coord.kill()
    wait_until(lambda: "(attempt 20," in w.output(), 120,
               "the worker's 20th failed attempt, counted, in its log")
    out = w.output()
    lines = [l for l in out.splitlines() if "retrying with backoff" in l]
    assert "(attempt 1," in out, out[-2000:]
    assert len(lines) <= 3, "\n".join(lines)
    assert w.alive()
