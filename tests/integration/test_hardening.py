"""Hardening of zcoord: its database, its exposure, its event loop, its
HTTP server. Real zcoord and zworker processes on 127.0.0.1, real SQLite
files; each test would fail against a coordinator without the guard."""
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time

import pytest

from ztest import (BIN, SLOW, byte_dataset, events, http_get, submit, tiny_spec, wait_until,
                   workers_by_name)

HB, TIMEOUT = 200, 600


def zcoord(*args, timeout=30):
    return subprocess.run([f"{BIN}/zcoord", *args], capture_output=True, text=True,
                          timeout=timeout * SLOW)


def test_second_coordinator_on_one_database_is_refused(procs):
    coord = procs.coord(hb_ms=HB, timeout_ms=TIMEOUT)
    procs.worker(coord.grpc, "w0")
    wait_until(lambda: workers_by_name(coord).get("w0", {}).get("state") == "alive", 10, "w0")
    r = zcoord("--grpc", "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", coord.db)
    assert r.returncode == 1, r.stderr
    assert f"in use by another zcoord (pid {coord.pid}" in r.stderr, r.stderr
    # The first one goes on, and nobody was declared lost by the second.
    assert coord.alive()
    assert workers_by_name(coord)["w0"]["state"] == "alive"
    assert "lost" not in [e["kind"] for e in events(coord)]


def test_empty_database_is_refused_unless_new(procs, tmp_path):
    db = tmp_path / "empty.db"
    db.write_bytes(b"")
    r = zcoord("--grpc", "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", str(db))
    assert r.returncode == 1 and "is empty" in r.stderr and "--new-db" in r.stderr
    assert db.stat().st_size == 0
    coord = procs.coord(db=str(db), extra=["--new-db"])
    assert http_get(coord.http_port, "/healthz")[0] == 200


def test_damaged_database_is_refused_untouched(procs, tmp_path):
    db = str(tmp_path / "run.db")
    coord = procs.coord(db=db, hb_ms=HB)
    for i in range(30):
        procs.worker(coord.grpc, f"w{i:02d}-" + "x" * 100)
    wait_until(lambda: len(workers_by_name(coord)) == 30, 20, "30 workers")
    coord.signal(signal.SIGTERM)
    coord.wait(10)
    with sqlite3.connect(db) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages = c.execute("PRAGMA page_count").fetchone()[0]
    assert pages >= 3
    with open(db, "r+b") as f:  # the b-tree page of a table, overwritten
        f.seek(2 * 4096)
        f.write(b"\x5a" * 64)
    before = open(db, "rb").read()
    r = zcoord("--grpc", "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", db)
    assert r.returncode == 1 and "damaged" in r.stderr and "backup" in r.stderr, r.stderr
    assert open(db, "rb").read() == before


def varint(b, i):
    """A SQLite varint at b[i]: (value, the index after it)."""
    v = 0
    for k in range(8):
        v = (v << 7) | (b[i + k] & 0x7f)
        if not b[i + k] & 0x80:
            return v, i + k + 1
    return (v << 8) | b[i + 8], i + 9


def test_damaged_index_is_refused_untouched(procs, tmp_path):
    """One byte of an index page changed so that the page stays well-formed
    and sorted: quick_check (what zcoord used to run at start) passes, but
    the index no longer matches its table. zcoord refuses to start, naming
    the damage (integrity_check's words) and the restore procedure, and
    leaves the file as it was."""
    from ztest import http_post_json, byte_dataset, tiny_spec
    db = str(tmp_path / "run.db")
    train, val = byte_dataset(str(tmp_path / "data"), limit=20_000)
    coord = procs.coord(db=db, hb_ms=HB)
    for _ in range(3):  # logbook entries of jobs 1..3: rows of the index events_job
        assert http_post_json(coord.http_port, "/v1/jobs", tiny_spec(train, val, 5))[0] == 201
    coord.signal(signal.SIGTERM)
    coord.wait(10)
    with sqlite3.connect(db) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        root = c.execute("SELECT rootpage FROM sqlite_master WHERE name = 'events_job'").fetchone()[0]
        psz = c.execute("PRAGMA page_size").fetchone()[0]
    c.close()
    data = bytearray(open(db, "rb").read())
    page = (root - 1) * psz
    assert root > 1 and data[page] == 0x0a  # a leaf page of an index: (job_id, id) per row
    cells = int.from_bytes(data[page + 3:page + 5], "big")
    ptr = page + 8 + 2 * (cells - 1)  # the last cell: the largest (job_id, id)
    cell = page + int.from_bytes(data[ptr:ptr + 2], "big")
    size, p = varint(data, cell)
    hlen, q = varint(data, p)
    types = []
    while q < p + hlen:
        t, q = varint(data, q)
        types.append(t)
    assert types[-1] == 1 and data[p + size - 1] < 0x7f, types  # id: one byte
    data[p + size - 1] = 0x7f  # a larger id: still the largest key, now of no row
    open(db, "wb").write(data)
    check = subprocess.run(["sqlite3", db, "PRAGMA quick_check"], capture_output=True, text=True)
    assert check.stdout.strip() == "ok", check
    # A transaction left in the write-ahead log (a process that ended
    # without closing the database): a checkpoint would copy it into the
    # file, which must not happen to a refused one either.
    subprocess.run([sys.executable, "-c", "import os, sqlite3\n"
                    f"c = sqlite3.connect({db!r})\n"
                    "c.execute('PRAGMA wal_autocheckpoint = 0')\n"
                    "c.execute(\"INSERT INTO meta(key, value) VALUES('left', 1)\")\n"
                    "c.commit()\n"
                    "os._exit(0)\n"], check=True)
    assert os.path.getsize(db + "-wal") > 0
    before, wal = open(db, "rb").read(), open(db + "-wal", "rb").read()
    r = zcoord("--grpc", "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", db)
    assert r.returncode != 0, r.stderr
    assert f"database {db} is damaged (integrity_check: " in r.stderr, r.stderr
    assert "missing from index events_job" in r.stderr, r.stderr
    assert "left as it was" in r.stderr and "docs/deploy.md" in r.stderr, r.stderr
    assert open(db, "rb").read() == before and open(db + "-wal", "rb").read() == wal


def test_damaged_header_is_named(procs, tmp_path):
    """A header byte SQLite does not stop at (a file format write version of
    3: a database it only reads) used to give "attempt to write a readonly
    database" or none at all; zcoord names the damaged header and leaves
    the file as it was."""
    db = str(tmp_path / "run.db")
    coord = procs.coord(db=db, hb_ms=HB)
    coord.signal(signal.SIGTERM)
    coord.wait(10)
    with sqlite3.connect(db) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()
    with open(db, "r+b") as f:
        f.seek(18)
        f.write(b"\x03")
    before = open(db, "rb").read()
    r = zcoord("--grpc", "127.0.0.1:0", "--http", "127.0.0.1:0", "--db", db)
    assert r.returncode != 0, r.stderr
    assert (f"database {db} is not a usable SQLite database: its header is damaged (file format "
            "versions 3/2, expected 1 or 2)") in r.stderr, r.stderr
    assert "docs/deploy.md" in r.stderr and "readonly" not in r.stderr, r.stderr
    assert open(db, "rb").read() == before


def test_non_loopback_needs_credentials(procs, tmp_path):
    db = str(tmp_path / "exposed.db")
    r = zcoord("--grpc", "0.0.0.0:0", "--http", "127.0.0.1:0", "--db", db)
    assert r.returncode == 2 and "api_token" in r.stderr and "worker_secret" in r.stderr
    assert not os.path.exists(db)
    ok = procs.coord(db=db, extra=["--grpc", "0.0.0.0:0", "--api-token", "t",
                                   "--worker-secret", "s"], name="secured")
    assert http_get(ok.http_port, "/healthz")[0] == 200
    ok.signal(signal.SIGTERM)
    ok.wait(10)
    loose = procs.coord(db=db, extra=["--http", "0.0.0.0:0", "--insecure"], name="insecure")
    assert http_get(loose.http_port, "/healthz")[0] == 200
    assert "--insecure" in loose.output()


def test_paused_coordinator_loses_nobody(procs):
    """The whole zcoord process stopped (SIGSTOP) for three timeouts: when it
    resumes, its overdue liveness check must not declare the workers lost."""
    coord = procs.coord(hb_ms=HB, timeout_ms=TIMEOUT)
    for i in range(3):
        procs.worker(coord.grpc, f"w{i}")
    wait_until(lambda: all(w["state"] == "alive" for w in workers_by_name(coord).values())
               and len(workers_by_name(coord)) == 3, 10, "3 workers alive")
    seen = {n: w["last_seen_ms"] for n, w in workers_by_name(coord).items()}
    coord.signal(signal.SIGSTOP)
    try:
        time.sleep(3 * TIMEOUT / 1000)  # the pause under test, not a wait for a condition
    finally:
        coord.signal(signal.SIGCONT)
    wait_until(lambda: all(w["last_seen_ms"] > seen[n] + 3 * TIMEOUT
                           for n, w in workers_by_name(coord).items()), 10,
               "heartbeats after the pause")

    def stall():
        metrics = http_get(coord.http_port, "/metrics")[2]
        return [float(l.split()[1]) for l in metrics.splitlines()
                if l.startswith("ztrain_coordinator_loop_stall_max_seconds ")][0]

    # The liveness check that follows the pause measures the stall; the
    # loop may serve the queued heartbeats and HTTP calls before it, so the
    # events are read once it has run.
    wait_until(lambda: stall() >= 2 * TIMEOUT / 1000, 10, "the loop's stall measured")
    kinds = [e["kind"] for e in events(coord)]
    assert "lost" not in kinds and "suspect" not in kinds, kinds


def test_one_client_cannot_take_every_http_slot(procs):
    coord = procs.coord(hb_ms=HB)
    held = []
    try:
        for _ in range(64):  # the per-client limit
            s = socket.create_connection(("127.0.0.1", coord.http_port), timeout=5)
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            held.append(s)
        # One more from the same address is turned away...
        extra = socket.create_connection(("127.0.0.1", coord.http_port), timeout=5)
        extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        extra.settimeout(5 * SLOW)
        try:
            assert extra.recv(100) == b""  # closed without an answer...
        except ConnectionResetError:
            pass  # ...or reset
        extra.close()
        # ...while another client address is served.
        other = socket.socket()
        other.bind(("127.0.0.2", 0))
        other.settimeout(5 * SLOW)
        other.connect(("127.0.0.1", coord.http_port))
        other.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert other.recv(100).startswith(b"HTTP/1.1 200")
        other.close()
    finally:
        for s in held:
            s.close()


# ---- paths from job specs --------------------------------------------------------

def post_spec(coord, spec):
    from ztest import http_post_json
    return http_post_json(coord.http_port, "/v1/jobs", spec)


def test_spec_paths_are_confined_at_submit(procs, tmp_path):
    from ztest import byte_dataset, tiny_spec
    train, val = byte_dataset(str(tmp_path / "data"), limit=60_000)
    coord = procs.coord(hb_ms=HB)
    cases = [
        ({"checkpoint": {"dir": "/", "every_steps": 5}}, "checkpoint.dir"),
        ({"checkpoint": {"dir": "/etc/ztrain-ckpt"}}, "checkpoint.dir"),
        ({"checkpoint": {"dir": str(tmp_path / "ck"), "load": str(tmp_path) + "/../../etc"}},
         "checkpoint.load"),
        ({"data": {"train": "/etc/passwd", "val": val}}, "data.train"),
        ({"data": {"train": train, "val": "/proc/self/environ"}}, "data.val"),
        # Epochs the replica stores would refuse: too deep, or hidden.
        ({"checkpoint": {"dir": str(tmp_path / "a/b/c/d/e/f/g/h")}}, "checkpoint.dir"),
        ({"checkpoint": {"dir": str(tmp_path / ".hidden" / "ck")}}, "checkpoint.dir"),
    ]
    for extra, key in cases:
        spec = tiny_spec(train, val, 5, **extra)
        code, body = post_spec(coord, spec)
        assert code == 400 and body["error"].startswith(key), (extra, code, body)
    # Nothing was written outside, and no job was created.
    assert not os.path.exists("/etc/ztrain-ckpt")
    assert http_get(coord.http_port, "/v1/jobs")[2]["jobs"] == []
    # The same spec with paths inside the roots is accepted.
    code, body = post_spec(coord, tiny_spec(train, val, 5))
    assert code == 201, body


def test_fault_injection_needs_the_test_flag(procs, tmp_path):
    from ztest import byte_dataset, tiny_spec
    train, val = byte_dataset(str(tmp_path / "data"), limit=60_000)
    coord = procs.coord(hb_ms=HB, test_knobs=False)
    spec = tiny_spec(train, val, 5, fault_injection={"lr_scale": 1000, "from_step": 2})
    code, body = post_spec(coord, spec)
    assert code == 400 and "fault_injection" in body["error"] and "--allow-test-knobs" in body["error"]


def test_symlink_out_of_the_data_root_fails_the_job(procs, tmp_path):
    """A data file inside the root that is a symbolic link to elsewhere: the
    lexical check at submit passes, the worker's real-path check refuses it,
    and the job fails with the reason (not the file's bytes)."""
    from ztest import byte_dataset, start_fleet, submit, tiny_spec, wait_job
    train, val = byte_dataset(str(tmp_path / "data"), limit=60_000)
    os.symlink("/etc/passwd", str(tmp_path / "data" / "train_000009.bin"))
    coord = start_fleet(procs, 1)
    jid = submit(coord, tiny_spec(train, val, 5), tmp_path)
    j = wait_job(coord, jid, timeout=60, states=("failed",))
    assert "leads outside the data root" in j["message"], j
    assert "root:" not in j["message"]  # no line of /etc/passwd in the reason


def test_data_missing_on_one_host_is_that_workers_failure(procs, tmp_path):
    """One worker's host lacks the data (its data directory is an empty
    mount there): its failure is its own, reported as local, and when it
    repeats on that worker, the worker is kept out of the job, which goes
    on with the other one and completes. Before, the first such report
    failed the whole job for good, and then the repeat paused it although
    a worker that could go on was there."""
    import shutil
    from ztest import byte_dataset, start_fleet, submit, tiny_spec, wait_job
    if not shutil.which("unshare"):
        pytest.skip("unshare (util-linux) is needed")
    data = tmp_path / "data"
    train, val = byte_dataset(str(data), limit=60_000)
    coord = start_fleet(procs, names=["a"])
    wd = tmp_path / "work-b"
    argv = [f"{BIN}/zworker", "--coordinator", coord.grpc, "--name", "b", "--workdir", str(wd),
            "--device", "cpu", "--data-root", procs.root, "--checkpoint-root", procs.root,
            "--threads", "1"]
    b = procs.start("b", ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                          f'mount -t tmpfs none "{data}" && exec "$@"', "sh"] + argv, None)
    wait_until(lambda: workers_by_name(coord).get("b", {}).get("state") == "alive", 20, "b")
    spec = tiny_spec(train, val, 30, workers=1, max_workers=2)
    jid = submit(coord, spec, tmp_path)
    assert wait_job(coord, jid, timeout=120)["state"] == "completed"
    ev = events(coord, job=jid)
    assert not [e for e in ev if e["kind"] in ("job_failed", "job_paused")], ev
    out = [e for e in ev if e["kind"] == "worker_excluded"]
    bid = workers_by_name(coord)["b"]["id"]
    assert len(out) == 1 and out[0]["worker_id"] == bid, out
    assert "no file matches" in out[0]["detail"] and "worker b" in out[0]["detail"], out
    failed = [e for e in ev if e["kind"] == "rank_failed" and "no file matches" in e["detail"]]
    # Repeated events are folded into one with a count.
    assert sum(e.get("count", 1) for e in failed) == 2, failed
    assert all(e["worker_id"] == bid for e in failed), failed
    assert b.alive()


def test_rank0_without_its_step_reporter_reports_and_pauses(procs, tmp_path):
    """Rank 0 whose step reporter thread cannot be started (test knob
    ZT_FAULT_NO_STEP_REPORTER, as pthread_create failing) does not train
    without it, which filled the report queue and then waited for good:
    it reports a local failure naming the cause, and when that repeats the
    job pauses with it. The worker stays registered and alive."""
    from ztest import byte_dataset, start_fleet, submit, tiny_spec, wait_job
    train, val = byte_dataset(str(tmp_path / "data"), limit=60_000)
    coord = start_fleet(procs, 1, worker_env={"ZT_FAULT_NO_STEP_REPORTER": "1"})
    jid = submit(coord, tiny_spec(train, val, 80), tmp_path)
    j = wait_job(coord, jid, timeout=60, states=("paused",))
    assert "same local error" in j["message"], j
    assert "cannot start the step reporter thread" in j["message"], j
    failed = [e["detail"] for e in events(coord, job=jid) if e["kind"] == "rank_failed"]
    assert failed and all("step reporter" in d for d in failed), failed
    assert coord.workers["w0"].alive()
    assert workers_by_name(coord)["w0"]["state"] == "alive"


def test_bad_shard_error_does_not_echo_the_file(procs, tmp_path):
    from ztest import byte_dataset, start_fleet, submit, tiny_spec, wait_job
    train, val = byte_dataset(str(tmp_path / "data"), limit=60_000)
    secret = b"SECRET-API-TOKEN-0123456789abcdef"
    with open(str(tmp_path / "data" / "train_000009.bin"), "wb") as f:
        f.write(secret * 64)
    coord = start_fleet(procs, 1)
    jid = submit(coord, tiny_spec(train, val, 5), tmp_path)
    j = wait_job(coord, jid, timeout=60, states=("failed",))
    assert "not a token shard" in j["message"], j
    text = " ".join(e["detail"] for e in events(coord, job=jid)) + j["message"]
    assert "SECRET" not in text
    for n in (int.from_bytes(secret[:4], "little"), int.from_bytes(secret[:4], "big")):
        assert str(n) not in text


@pytest.mark.parametrize("stage", [0, 3])
def test_bad_validation_batch_of_one_rank_fails_every_rank_with_its_reason(procs, tmp_path,
                                                                           stage):
    """Rank 1's validation batch holds a token beyond the vocabulary: every
    rank still joins the evaluation's collectives (stage 3's forwards
    gather parameters), then every rank fails: rank 1 naming the token, as
    a local fault (twice at the same step: the job pauses with it), rank 0
    saying the batch was another rank's. No rank waits for a collective
    the other never calls (which failed every generation as a ring timeout
    or mismatched calls, blaming the wrong rank)."""
    from ztest import byte_dataset, start_fleet, submit, tiny_spec, wait_job, write_shard
    train, _ = byte_dataset(str(tmp_path / "data"), limit=60_000)
    # Batch 0 (rank 0: samples 0-1 of 33 tokens) is good; batch 1 is not.
    write_shard(str(tmp_path / "data" / "badval_000000.bin"), [65] * 70 + [300] * 2000)
    coord = start_fleet(procs, 2)
    spec = tiny_spec(train, str(tmp_path / "data" / "badval_*.bin"), 20, stage=stage, workers=2,
                     eval={"every_steps": 2, "batches": 2})
    jid = submit(coord, spec, tmp_path)
    j = wait_job(coord, jid, timeout=60, states=("paused",))
    assert "the same local error twice at step 2" in j["message"], j
    assert "validation:" in j["message"] and "token 300 at index 70 is >= vocab_size 257" \
        in j["message"], j
    wait_until(lambda: any("validation: a batch of another rank could not be read" in w.output()
                           for w in coord.workers.values()), 10, "rank 0's reason")
    failed = [e["detail"] for e in events(coord, job=jid) if e["kind"] == "rank_failed"]
    assert failed and all("timed out" not in d and "differ" not in d for d in failed), failed


def test_shipped_config_placeholders_are_refused(procs, tmp_path):
    import json as _json
    from ztest import SRC
    cfg = _json.load(open(os.path.join(SRC, "deploy", "zcoord.json")))
    cfg.update(db=str(tmp_path / "z.db"), data_root=str(tmp_path),
               checkpoint_root=str(tmp_path), grpc="127.0.0.1:0", http="127.0.0.1:0")
    path = tmp_path / "zcoord.json"
    path.write_text(_json.dumps(cfg))
    r = zcoord("--config", str(path))
    assert r.returncode == 2 and "placeholder" in r.stderr and "openssl rand" in r.stderr
    cfg.update(api_token="a" * 64, worker_secret="b" * 64)
    path.write_text(_json.dumps(cfg))
    coord = procs.coord(extra=["--config", str(path)])
    assert http_get(coord.http_port, "/healthz")[0] == 200


def test_zctl_escapes_text_and_checks_numbers(procs, tmp_path):
    from ztest import byte_dataset, submit, tiny_spec, zctl
    train, val = byte_dataset(str(tmp_path / "data"), limit=60_000)
    coord = procs.coord(hb_ms=HB)
    spec = tiny_spec(train, val, 5)
    spec["name"] = "evil\x1b]0;owned\x07\x1b[2J"
    jid = submit(coord, spec, tmp_path)
    out = zctl(coord.grpc, "jobs").stdout + zctl(coord.grpc, "events").stdout
    assert "\x1b" not in out and "\x07" not in out
    assert "evil\\x1b]0;owned\\x07" in out
    for args in (["rollback", str(jid), "--to-step", "99999999999999999999"],
                 ["rollback", str(jid), "--to-step", "-5"],
                 ["metrics", str(jid), "--from", "3x"],
                 ["events", "--limit", "0"]):
        r = zctl(coord.grpc, *args, check=False)
        assert r.returncode == 1 and "expected an integer" in r.stderr, (args, r.stderr)
    code, _, body = http_get(coord.http_port, f"/v1/jobs/{jid}/metrics?from=99999999999999999999")
    assert code == 400 and "from" in body["error"]


def test_text_from_the_network_cannot_split_or_forge_a_log_line(procs, tmp_path):
    """A job named with a newline, a line that looks like the
    coordinator's own and a terminal escape: zcoord's log shows the name
    escaped on the line of the event, and no forged line starts."""
    train, val = byte_dataset(str(tmp_path / "data"), limit=60_000)
    coord = procs.coord()
    forged = "12:00:00.000 ERROR zcoord: the database is corrupt"
    spec = tiny_spec(train, val, 5)
    spec["name"] = f"evil\n{forged}\x1b[31m"
    submit(coord, spec, tmp_path)
    line = wait_until(lambda: [ln for ln in coord.output().splitlines()
                               if "event job_accepted" in ln], 10, "the job_accepted line")[0]
    assert f'"evil\\x0a{forged}\\x1b[31m"' in line, line
    assert not any(ln.startswith(forged) for ln in coord.output().splitlines())
    assert "\x1b" not in coord.output()
