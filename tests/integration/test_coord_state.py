"""The coordinator's state under refused writes and reports that do not fit.

zcoord keeps its state in memory and in SQLite; what it shows must be what
it stored. Here the database refuses writes the way it does in production:
another writer holds SQLite's write lock past zcoord's busy timeout (5 s),
so zcoord's write fails with "database is locked". The workers are played
by this test over gRPC with real credentials (hand-encoded messages, see
test_rpc_robustness.py), so every report arrives exactly when the test
says; zcoord, its database and the job are real.

Each test would fail against a coordinator without its guard:
- a step whose write failed must not show as the job's step;
- a generation whose write failed must be formed again later, not never;
- a rank's checkpoint report that failed half-way must count in full when
  the rank retries, so the epoch never commits without one of its files;
- an epoch whose write failed is deleted even when the first try to record
  that was refused (also when the rank that made it fail was answered OK),
  and never through a link that leads out of the root;
- an epoch is named in one spelling only, the one of its step and
  generation: another spelling of a committed epoch passes for nothing;
- a copy report from a worker outside the job, or naming a file the epoch
  does not have, is refused;
- an operator's rollback with nothing to skip adds no skip range;
- an operator's pause, cancel, resume or rollback whose write is refused
  is refused and changes nothing (a paused job stays paused);
- a job's state whose write was refused is stored a few seconds after the
  database is back, not only at the job's next change;
- a job's metrics come back in pages of at most 10000 steps.
"""
import contextlib
import os
import sqlite3
import struct
import time

import grpc
import pytest

from test_rpc_robustness import call, cred, field_bytes, field_varint, read_varint, varint
from ztest import (byte_dataset, events, http_get, job, submit, tiny_spec, wait_until,
                   zctl_json)

REGISTER = "/ztrain.Control/RegisterWorker"
OK = grpc.StatusCode.OK


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=50_000)


def fields(buf):
    """[(field number, value)] of a message, in order (repeated fields
    appear once per value; doubles as floats)."""
    out, i = [], 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        if key & 7 == 0:
            v, i = read_varint(buf, i)
        elif key & 7 == 2:
            n, i = read_varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif key & 7 == 1:
            v, i = struct.unpack("<d", buf[i:i + 8])[0], i + 8
        elif key & 7 == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError(f"wire type {key & 7}")
        out.append((key >> 3, v))
    return out


def field_double(num, v):
    return varint((num << 3) | 1) + struct.pack("<d", v)


class RawWorker:
    """A worker played by the test: registered (it fits any job, and names
    a replica store so that its epochs count as loadable), then every call
    carries its id and session."""

    def __init__(self, ch, name, host=None, held=()):
        self.ch, self.name = ch, name
        code, reply, det = call(ch, REGISTER, field_bytes(1, name.encode()) + field_bytes(3, b"cpu")
                                + field_varint(8, 16 << 30) + field_bytes(10, b"127.0.0.1:9")
                                + (field_bytes(2, host.encode()) if host else b"")
                                + b"".join(field_bytes(11, h.encode()) for h in held))
        assert code == OK, det
        f = dict(fields(reply))
        self.id, self.session = f[1], f[5]

    def call(self, method, body=b"", timeout=5):
        return call(self.ch, "/ztrain.Control/" + method, cred(self.id, self.session) + body,
                    timeout=timeout)

    def assignment(self):
        """(job, generation) its heartbeat reply names."""
        code, reply, det = self.call("Heartbeat")
        assert code == OK, det
        f = dict(fields(reply))
        return f.get(2, 0), f.get(3, 0)


class RawJob:
    """zcoord, raw workers, and one job of `world` ranks formed from them."""

    def __init__(self, procs, tmp_path, data, n_workers=1, world=1, steps=100, **spec):
        self.procs = procs
        self.coord = procs.coord(hb_ms=200, timeout_ms=60000)
        self.ch = grpc.insecure_channel(self.coord.grpc)
        self.workers = [RawWorker(self.ch, f"raw{i}") for i in range(n_workers)]
        train, val = data
        self.ck = os.path.join(os.path.realpath(str(tmp_path)), "ck")
        self.jid = submit(self.coord, tiny_spec(train, val, steps, workers=world,
                                                checkpoint={"dir": self.ck, "every_steps": 1000},
                                                **spec), tmp_path)
        self.gen = 0
        self.ranks = self.wait_generation(1)

    def wait_generation(self, gen):
        """Waits until generation gen is formed and its members know it;
        returns the members by rank."""
        def formed():
            with sqlite3.connect(self.coord.db) as db:
                rows = db.execute("SELECT rank, worker_id FROM members WHERE job_id = ? AND "
                                  "gen = ? ORDER BY rank", (self.jid, gen)).fetchall()
            by_id = {w.id: w for w in self.workers}
            ranks = [by_id[wid] for _, wid in rows]
            return ranks if ranks and all(w.assignment() == (self.jid, gen) for w in ranks) \
                else None
        ranks = wait_until(formed, 20, f"generation {gen} of job {self.jid} formed")
        self.gen = gen
        return ranks

    def head(self):
        return field_varint(2, self.jid) + field_varint(3, self.gen)

    def report_step(self, w, step, loss=2.5, timeout=5):
        return w.call("ReportStep", self.head() + field_varint(4, step) + field_double(5, loss),
                      timeout=timeout)

    def epoch_rel(self, step):
        path = os.path.join(self.ck, f"job_{self.jid}", f"step_{step:08d}-g{self.gen}")
        return os.path.relpath(path, self.procs.root)

    @staticmethod
    def files_of(rank):
        """(name, bytes, checksum) of the files rank writes to an epoch."""
        names = (["manifest.json"] if rank == 0 else []) + [f"rank_{rank}.bin", f"rank_{rank}.json"]
        return [(n, 1000 + i, f"xxh64:{rank:08x}{i:08x}") for i, n in enumerate(names)]

    @staticmethod
    def file_msg(name, size, checksum):
        return field_bytes(1, name.encode()) + field_varint(2, size) + field_bytes(3, checksum.encode())

    def report_ring_failure(self, w, timeout=60):
        """w reports that the ring broke (a peer failure)."""
        return w.call("ReportFailure", self.head() + field_bytes(4, b"ring broke")
                      + field_varint(9, 1), timeout=timeout)

    def report_checkpoint(self, rank, step, timeout=5):
        body = self.head() + field_varint(4, step) + field_bytes(5, self.epoch_rel(step).encode())
        for f in self.files_of(rank):
            body += field_bytes(6, self.file_msg(*f))
        return self.ranks[rank].call("ReportCheckpoint", body, timeout=timeout)

    def report_copy(self, w, step, name, size=1000, checksum="xxh64:00000000000000aa"):
        body = (field_varint(2, self.jid) + field_bytes(3, self.epoch_rel(step).encode())
                + field_bytes(4, self.file_msg(name, size, checksum)))
        return w.call("ReportReplica", body)

    def recorded_files(self, step):
        with sqlite3.connect(self.coord.db) as db:
            return sorted(r[0] for r in db.execute(
                "SELECT name FROM checkpoint_files WHERE job_id = ? AND step = ?", (self.jid, step)))

    def close(self):
        self.ch.close()


@pytest.fixture
def raw(procs, tmp_path, data, request):
    jobs = []

    def make(**kw):
        j = RawJob(procs, tmp_path, data, **kw)
        jobs.append(j)
        return j
    yield make
    for j in jobs:
        j.close()


@contextlib.contextmanager
def db_locked(path):
    """Holds the database's write lock as another writer would: zcoord's
    writes wait its busy timeout, then fail ("database is locked")."""
    db = sqlite3.connect(path, isolation_level=None, timeout=10)
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    finally:
        db.execute("ROLLBACK")
        db.close()


def test_refused_step_write_leaves_the_job_at_the_stored_step(raw):
    r = raw()
    w = r.ranks[0]
    assert r.report_step(w, 1, loss=3.0)[0] == OK
    with db_locked(r.coord.db) as db:
        code, _, det = r.report_step(w, 2, loss=2.0, timeout=30)
        assert code == grpc.StatusCode.UNAVAILABLE and "cannot store step" in det, (code, det)
        stored = db.execute("SELECT MAX(step) FROM steps WHERE job_id = ?", (r.jid,)).fetchone()[0]
        # (zcoord's other writes wait too, the HTTP call with them)
        j = http_get(r.coord.http_port, f"/v1/jobs/{r.jid}", timeout=30)[2]
        assert stored == 1 and j["step"] == 1 and j["loss"] == 3.0, j
    # The rank's retry stores it.
    assert r.report_step(w, 2, loss=2.0)[0] == OK
    j = job(r.coord, r.jid)
    assert j["step"] == 2 and j["loss"] == 2.0, j


def test_refused_generation_write_forms_it_later(raw):
    r = raw()
    w = r.ranks[0]
    assert r.report_step(w, 1)[0] == OK
    # The failure re-forms the job at once, and the new generation's
    # write is refused (each of zcoord's writes meanwhile waits 5 s).
    with db_locked(r.coord.db):
        code, _, det = r.report_ring_failure(w)
        assert code == OK, det
    # The database is back: the job forms it after its backoff, with the
    # same worker; the log said why it waited.
    assert r.wait_generation(2) == [w]
    assert "cannot store generation 2" in r.coord.output()


def test_checkpoint_report_refused_half_way_counts_in_full_on_retry(raw):
    r = raw(n_workers=2, world=2)
    code, reply, det = r.report_checkpoint(1, 10)
    assert code == OK and dict(fields(reply)).get(1, 0) == 0, det
    with db_locked(r.coord.db):
        code, _, det = r.report_checkpoint(0, 10, timeout=30)
        assert code == grpc.StatusCode.UNAVAILABLE and "cannot record the copy" in det, (code, det)
    assert r.recorded_files(10) == []  # not committed
    code, reply, det = r.report_checkpoint(0, 10)
    assert code == OK and dict(fields(reply)).get(1) == 1, det  # committed now
    assert r.recorded_files(10) == sorted(["manifest.json", "rank_0.bin", "rank_0.json",
                                           "rank_1.bin", "rank_1.json"])


def test_refused_deletion_of_a_failed_epoch_is_retried(raw):
    r = raw(n_workers=2, world=2)

    def report_error(rank, timeout=5):
        body = (r.head() + field_varint(4, 30) + field_bytes(5, r.epoch_rel(30).encode())
                + field_bytes(7, b"No space left on device"))
        return r.ranks[rank].call("ReportCheckpoint", body, timeout=timeout)
    assert report_error(1)[0] == OK  # the epoch cannot commit now
    with db_locked(r.coord.db):  # the last report: the epoch is to be deleted
        code, _, det = report_error(0, timeout=30)
        assert code == grpc.StatusCode.UNAVAILABLE, (code, det)
        assert "step 30: cannot delete the failed epoch" in det, det
    assert report_error(0)[0] == OK  # the rank's retry
    code, _, ck = http_get(r.coord.http_port, f"/v1/jobs/{r.jid}/checkpoints")
    assert code == 200 and [(c["step"], c["state"]) for c in ck["checkpoints"]] == [(30, "deleted")]


def test_refused_deletion_after_an_answered_failure_is_retried(raw):
    """The epoch's first failure is also its last report: the rank is
    answered OK (the scheduler must learn of the failure), so no retry of
    the rank's will delete the epoch: the coordinator tries again itself."""
    r = raw(n_workers=2, world=2)
    assert r.report_checkpoint(1, 30)[0] == OK
    body = (r.head() + field_varint(4, 30) + field_bytes(5, r.epoch_rel(30).encode())
            + field_bytes(7, b"No space left on device"))
    with db_locked(r.coord.db):
        code, _, det = r.ranks[0].call("ReportCheckpoint", body, timeout=60)
        assert code == OK, (code, det)

    def state():
        code, _, ck = http_get(r.coord.http_port, f"/v1/jobs/{r.jid}/checkpoints", timeout=30)
        assert code == 200, ck
        return [(c["step"], c["state"]) for c in ck["checkpoints"]]
    wait_until(lambda: state() == [(30, "deleted")], 20, "the failed epoch deleted")


def test_epochs_are_named_in_one_spelling(raw):
    r = raw(n_workers=2, world=2)
    # A report names the directory of its own step and generation.
    body = r.head() + field_varint(4, 10) + field_bytes(5, r.epoch_rel(20).encode())
    for f in r.files_of(1):
        body += field_bytes(6, r.file_msg(*f))
    code, _, det = r.ranks[1].call("ReportCheckpoint", body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, det)
    assert "is the epoch of step 20, generation 1; the report is for step 10" in det, det
    assert r.report_checkpoint(1, 10)[0] == OK
    code, reply, det = r.report_checkpoint(0, 10)
    assert code == OK and dict(fields(reply)).get(1) == 1, det
    # The committed epoch under other spellings: no copy, no record.
    canon = r.epoch_rel(10)
    parent = os.path.dirname(canon)
    # ("./step_00000010-g1" is the same path once normalized.)
    for other in ("step_10-g1", "step_+0000010-g1", "step_00000010-g01",
                  "step_00000010-g1/x"):
        body = (field_varint(2, r.jid) + field_bytes(3, f"{parent}/{other}".encode())
                + field_bytes(4, r.file_msg("rank_0.bin", 999, "xxh64:00000000000000bb")))
        code, _, det = r.ranks[1].call("ReportReplica", body)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (other, code, det)
        assert "is not an epoch directory of job" in det, (other, det)
    # The canonical spelling is checked against the record.
    code, _, det = r.report_copy(r.ranks[1], 10, "rank_0.bin", size=999,
                                 checksum="xxh64:00000000000000bb")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "differs" in det, (code, det)
    code, _, ck = http_get(r.coord.http_port, f"/v1/jobs/{r.jid}/checkpoints")
    assert [(c["step"], c["state"]) for c in ck["checkpoints"]] == [(10, "committed")], ck
    with sqlite3.connect(r.coord.db) as db:
        n = db.execute("SELECT COUNT(*) FROM checkpoints WHERE job_id = ?", (r.jid,)).fetchone()[0]
    assert n == 1


def test_failed_epoch_deleted_only_inside_the_root(raw, tmp_path):
    """A failed epoch's directory goes once every rank has reported; but
    where a symbolic link in its path (job_N on the shared storage) leads
    out of the checkpoint root, the coordinator leaves it and says why."""
    r = raw(n_workers=1, world=1)

    def report_error(step):
        body = (r.head() + field_varint(4, step) + field_bytes(5, r.epoch_rel(step).encode())
                + field_bytes(7, b"No space left on device"))
        return r.ranks[0].call("ReportCheckpoint", body)
    job_dir = os.path.join(r.ck, f"job_{r.jid}")
    inside = os.path.join(job_dir, "step_00000020-g1")
    os.makedirs(inside)
    open(os.path.join(inside, "rank_0.bin"), "wb").close()
    assert report_error(20)[0] == OK
    wait_until(lambda: not os.path.exists(inside), 10, "the failed epoch inside the root deleted")
    # job_N now leads elsewhere: outside the root (the procs' base directory).
    outside = os.path.join("/var/tmp", f"zt-outside-{os.getpid()}-{r.jid}")
    os.makedirs(os.path.join(outside, "step_00000030-g1"))
    keep = os.path.join(outside, "step_00000030-g1", "rank_0.bin")
    open(keep, "wb").close()
    try:
        os.rename(job_dir, job_dir + ".old")
        os.symlink(outside, job_dir)
        assert report_error(30)[0] == OK
        wait_until(lambda: "lies outside the checkpoint root" in r.coord.output(), 10,
                   "zcoord refusing to delete through the link")
        assert os.path.exists(keep)
    finally:
        import shutil
        shutil.rmtree(outside, ignore_errors=True)


def test_copy_reports_only_from_members_and_of_epoch_files(raw):
    r = raw(n_workers=3, world=2)
    outsider = next(w for w in r.workers if w not in r.ranks)
    # A registered worker outside the job cannot fill the epoch's tally.
    for i in range(3 * 256 + 8):
        code, _, det = r.report_copy(outsider, 20, f"junk_{i}.bin")
        assert code == grpc.StatusCode.FAILED_PRECONDITION, (i, code, det)
        assert f"worker {outsider.name} is not a member of generation 1" in det, det
    code, _, det = r.report_copy(outsider, 20, "rank_0.bin")
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, det)
    # A member reports only files an epoch of two ranks has.
    for name in ("junk.bin", "rank_2.bin", "rank_01.bin", "rank_0.txt", "manifest.json.bak"):
        code, _, det = r.report_copy(r.ranks[1], 20, name)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, det)
        assert f'"{name}" is not a file of the 2-rank epoch' in det, det
    # The ranks' reports commit the epoch with every file they wrote.
    assert r.report_checkpoint(1, 20)[0] == OK
    code, reply, det = r.report_checkpoint(0, 20)
    assert code == OK and dict(fields(reply)).get(1) == 1, det
    assert r.recorded_files(20) == sorted(["manifest.json", "rank_0.bin", "rank_0.json",
                                           "rank_1.bin", "rank_1.json"])
    with sqlite3.connect(r.coord.db) as db:
        holders = db.execute("SELECT DISTINCT worker_id FROM checkpoint_copies WHERE job_id = ?",
                             (r.jid,)).fetchall()
    assert outsider.id not in {h[0] for h in holders}


def post(coord, path, body):
    from ztest import http_post_json
    return http_post_json(coord.http_port, path, body, timeout=30)


def skips(coord, jid):
    with sqlite3.connect(coord.db) as db:
        return db.execute("SELECT skips FROM jobs WHERE id = ?", (jid,)).fetchone()[0]


def test_rollback_with_nothing_to_skip_adds_no_skip_range(raw):
    r = raw()
    w = r.ranks[0]
    for s in range(1, 13):
        assert r.report_step(w, s)[0] == OK
    code, reply, det = r.report_checkpoint(0, 10)
    assert code == OK and dict(fields(reply)).get(1) == 1, det
    # Back to step 10, skipping the data of 5 steps: one range.
    code, body = post(r.coord, f"/v1/jobs/{r.jid}/rollback", {"to_step": 10, "skip": 5})
    assert code == 200, body
    r.wait_generation(2)
    before = skips(r.coord, r.jid)
    assert before, "the first rollback skipped nothing"
    # Back to the start, skipping nothing: the skip list stays as it was.
    code, body = post(r.coord, f"/v1/jobs/{r.jid}/rollback", {"to_step": 0, "skip": 0})
    assert code == 200, body
    r.wait_generation(3)
    assert skips(r.coord, r.jid) == before
    kinds = [e["kind"] for e in events(r.coord, job=r.jid)]
    assert kinds.count("rollback") == 2 and kinds.count("skip_range") == 1, kinds


def state_of(r):
    """(state in memory, as served; state stored) of r's job."""
    j = http_get(r.coord.http_port, f"/v1/jobs/{r.jid}", timeout=30)[2]
    with sqlite3.connect(r.coord.db, timeout=30) as db:
        stored = db.execute("SELECT state FROM jobs WHERE id = ?", (r.jid,)).fetchone()[0]
    return j["state"], stored


def test_refused_operator_actions_change_nothing(raw):
    r = raw()
    w = r.ranks[0]
    assert r.report_step(w, 1)[0] == OK
    running = state_of(r)
    with db_locked(r.coord.db):
        for action, body in (("pause", {}), ("cancel", {}), ("rollback", {"to_step": 0})):
            code, reply = post(r.coord, f"/v1/jobs/{r.jid}/{action}", body)
            assert code == 503, (action, code, reply)
            assert "nothing changed" in reply["error"] and "locked" in reply["error"], reply
    assert state_of(r) == running
    assert w.assignment() == (r.jid, 1)  # still a member of generation 1
    code, reply = post(r.coord, f"/v1/jobs/{r.jid}/pause", {})
    assert code == 200, reply
    paused = state_of(r)
    assert paused[0] == "paused", paused
    # A paused job stays paused when its resumption or rollback is refused
    # (a rollback first takes it out of "paused": that must be undone).
    with db_locked(r.coord.db):
        for action, body in (("resume", {}), ("rollback", {"to_step": 0})):
            code, reply = post(r.coord, f"/v1/jobs/{r.jid}/{action}", body)
            assert code == 503 and "nothing changed" in reply["error"], (action, code, reply)
    assert state_of(r) == paused
    code, reply = post(r.coord, f"/v1/jobs/{r.jid}/rollback", {"to_step": 0})
    assert code == 200, reply
    r.wait_generation(2)
    kinds = [e["kind"] for e in events(r.coord, job=r.jid)]
    assert kinds.count("rollback") == 1 and kinds.count("job_paused") == 1, kinds


def test_refused_job_write_is_stored_when_the_database_is_back(raw):
    # A long backoff: nothing but the flush writes the job again soon.
    r = raw(elastic={"min_workers": 1, "max_workers": 1, "backoff_ms": 120000})
    w = r.ranks[0]
    assert r.report_step(w, 1)[0] == OK
    with db_locked(r.coord.db):
        code, _, det = r.report_ring_failure(w)
        assert code == OK, det
        msg = http_get(r.coord.http_port, f"/v1/jobs/{r.jid}", timeout=30)[2]["message"]
        assert "cannot store generation 2" in msg, msg

    def stored():
        with sqlite3.connect(r.coord.db, timeout=30) as db:
            return db.execute("SELECT message FROM jobs WHERE id = ?", (r.jid,)).fetchone()[0]
    wait_until(lambda: stored() == msg, 20, "the job's state stored once the database is back")
    assert "state stored after" in r.coord.output()


def steps_of(reply):
    """The step numbers of a GetMetricsReply."""
    return [dict(fields(v))[1] for f, v in fields(reply) if f == 1]


def test_metrics_come_in_pages(raw):
    cap, total = 10000, 10040
    r = raw(steps=total)
    w = r.ranks[0]
    for s in range(1, total + 1):
        code, _, det = r.report_step(w, s, loss=1.0 + 1.0 / s)
        assert code == OK, (s, det)
    p, path = r.coord.http_port, f"/v1/jobs/{r.jid}/metrics"
    # Asked for everything, the API returns the first `cap` steps...
    code, _, m = http_get(p, path)
    assert code == 200 and [s["step"] for s in m["steps"]] == list(range(1, cap + 1))
    # ...and the next page the rest.
    code, _, m = http_get(p, f"{path}?from={cap + 1}")
    assert code == 200 and [s["step"] for s in m["steps"]] == list(range(cap + 1, total + 1))
    code, _, m = http_get(p, f"{path}?from=100&limit=5")
    assert code == 200 and [s["step"] for s in m["steps"]] == list(range(100, 105))
    for bad in (0, cap + 1, 1 << 40):
        code, _, m = http_get(p, f"{path}?limit={bad}")
        assert code == 400 and "limit must be 1..10000" in m["error"], (bad, m)
    # The gRPC call: a larger limit is read as the cap; pages by from_step.
    for limit in (0, cap + 1, 50000):
        code, reply, det = call(r.ch, "/ztrain.Status/GetMetrics",
                                field_varint(1, r.jid) + field_varint(4, limit))
        assert code == OK and steps_of(reply) == list(range(1, cap + 1)), (limit, det)
    code, reply, det = call(r.ch, "/ztrain.Status/GetMetrics",
                            field_varint(1, r.jid) + field_varint(2, cap + 1))
    assert code == OK and steps_of(reply) == list(range(cap + 1, total + 1)), det
    # zctl reads every page.
    got = zctl_json(r.coord.grpc, "metrics", str(r.jid))["steps"]
    assert [s["step"] for s in got] == list(range(1, total + 1))


def ckpt_states(r):
    """{step: state} of r's job's epochs (1 committed, 2 deleted)."""
    with sqlite3.connect(r.coord.db) as db:
        return dict(db.execute("SELECT step, state FROM checkpoints WHERE job_id = ?", (r.jid,)))


def steps_and_epochs(r, last, every=10, loss=2.5):
    """Steps 1..last of rank 0 at `loss`, an epoch committed every `every`."""
    w = r.ranks[0]
    for s in range(1, last + 1):
        assert r.report_step(w, s, loss)[0] == OK
        if s % every == 0:
            code, reply, det = r.report_checkpoint(0, s)
            assert code == OK and dict(fields(reply)).get(1) == 1, det


def rollback_detail(r):
    ev = [e for e in events(r.coord, job=r.jid) if e["kind"] == "rollback"]
    return ev[-1]["detail"] if ev else None


def spike_rollback(r, first):
    """Rank 0 reports loss 50 at steps first..first + 2 (the detector's
    patience); returns the rollback event's detail."""
    for s in range(first, first + 3):
        r.report_step(r.ranks[0], s, 50.0)
    return wait_until(lambda: rollback_detail(r), 10, "rollback")


def test_spike_rollback_target_survives_retention(raw):
    """keep_last 2 with margin_steps 25: the epoch a spike from step 46 must
    go back to (at or before step 19) is older than the last two. Retention
    now keeps it; before, it was deleted, the rollback found no epoch and
    deleted every one, starting over from initialization."""
    r = raw(rollback={"enabled": True, "margin_steps": 25})
    steps_and_epochs(r, 45)
    detail = spike_rollback(r, 46)
    assert "restarting from checkpoint (step 10)" in detail, detail
    assert ckpt_states(r)[10] == 1


def test_spike_rollback_skips_the_epoch_of_the_update_before_it(raw):
    """The loss of step 21 is computed before update 21, after update 20:
    a spike first seen at 21 may come from update 20, which epoch 20 holds.
    The rollback goes to epoch 10 (it went to 20 and restored the bad
    weights)."""
    r = raw(rollback={"enabled": True, "margin_steps": 0})
    steps_and_epochs(r, 20)
    detail = spike_rollback(r, 21)
    assert "(step 10)" in detail, detail
    assert ckpt_states(r)[20] == 2


def test_spike_pause_deletes_the_epochs_of_the_spike(raw):
    """With the rollback budget spent the job pauses; the epochs after the
    rollback target are deleted as a rollback's are, so a resume (even
    after a coordinator restart) does not continue from the spiked epoch."""
    r = raw(rollback={"enabled": True, "max_rollbacks": 0})
    steps_and_epochs(r, 30)
    w = r.ranks[0]
    assert r.report_step(w, 31, 50.0)[0] == OK
    assert r.report_step(w, 32, 50.0)[0] == OK
    code, reply, det = r.report_checkpoint(0, 32)
    assert code == OK, det
    r.report_step(w, 33, 50.0)
    wait_until(lambda: state_of(r) == ("paused", 5) or state_of(r)[0] == "paused", 10, "paused")
    states = ckpt_states(r)
    assert states[20] == 1 and states[30] == 2 and states.get(32, 2) == 2, states


def test_rollback_to_an_unreachable_epoch_deletes_nothing(raw, procs):
    """The only holder of epoch 10 leaves: the job pauses (no checkpoint
    can be loaded). An operator rollback to it is refused and deletes
    nothing; before, it deleted the epoch and started over from step 0."""
    r = raw()
    steps_and_epochs(r, 12)
    other = RawWorker(r.ch, "elsewhere", host="another-machine")
    r.workers.append(other)
    code, _, det = r.ranks[0].call("Leave", field_bytes(2, b"bye") + field_varint(5, 1))
    assert code == OK, det
    wait_until(lambda: state_of(r)[0] == "paused", 20, "paused without a loadable epoch")
    code, body = post(r.coord, f"/v1/jobs/{r.jid}/rollback", {"to_step": 10})
    assert code == 409 and "lacks a copy" in body["error"], body
    assert ckpt_states(r)[10] == 1
    assert state_of(r)[0] == "paused"


def test_registration_keeps_a_pending_epoch_of_the_running_generation(raw):
    """Workers of one machine share its checkpoint root: a worker that
    registers while rank 0 writes its files lists them. The epoch may
    still commit and is not queued for deletion (it was)."""
    r = raw(n_workers=2, world=2)
    code, reply, det = r.report_checkpoint(0, 5)
    assert code == OK, det
    rel = r.epoch_rel(5)
    late = RawWorker(r.ch, "late", held=[f"{rel}/rank_0.bin"])
    r.workers.append(late)
    with sqlite3.connect(r.coord.db) as db:
        rows = db.execute("SELECT dir FROM epoch_deletions WHERE worker_id = ?",
                          (late.id,)).fetchall()
    assert rows == [], rows
    code, reply, det = r.report_checkpoint(1, 5)
    assert code == OK and dict(fields(reply)).get(1) == 1, det


def test_never_committed_epoch_is_deleted_on_every_member(raw):
    """An epoch of generation 1 that never commits is deleted on every
    member of that generation, not only on those that reported files: a
    member stopped while it wrote (or received a copy) holds temporary
    files its holdings never list, and would keep the directory for good."""
    r = raw(n_workers=2, world=2)
    code, _, det = r.report_checkpoint(0, 5)  # rank 1 never reports
    assert code == OK, det
    rel = r.epoch_rel(5)
    code, _, det = r.report_ring_failure(r.ranks[0])
    assert code == OK, det
    r.wait_generation(2)

    def queued():
        with sqlite3.connect(r.coord.db) as db:
            rows = {w for (w,) in db.execute("SELECT worker_id FROM epoch_deletions WHERE dir = ?",
                                              (rel,))}
        return rows if len(rows) == 2 else None
    assert wait_until(queued, 10, "deletions on both members") == {w.id for w in r.workers}


def test_epoch_deletions_reach_their_worker_across_a_restart(raw):
    """A heartbeat asks the database for its worker's epoch deletions only
    while some may be queued for that worker (a fleet's heartbeats are
    otherwise a query each): a deletion reaches its worker, one worker's
    acknowledgement does not hide another's, and after a coordinator
    restart the pending ones are still delivered."""
    r = raw(n_workers=2, world=2)
    code, _, det = r.report_checkpoint(0, 5)  # never committed: deleted on both members
    assert code == OK, det
    rel = r.epoch_rel(5)
    code, _, det = r.report_ring_failure(r.ranks[0])
    assert code == OK, det
    a, b = r.wait_generation(2)

    def deletions(w, body=b""):
        code, reply, det = w.call("Heartbeat", body)
        assert code == OK, det
        return [v.decode() for k, v in fields(reply) if k == 6]
    wait_until(lambda: deletions(a) == [rel], 10, "the deletion in a's heartbeat reply")
    assert deletions(a, field_bytes(6, rel.encode())) == []
    assert deletions(a) == []
    assert deletions(b) == [rel]
    r.coord.kill()
    r.coord = r.procs.coord(db=r.coord.db, hb_ms=200, timeout_ms=60000, name="zcoord2",
                            grpc_port=r.coord.grpc_port)
    wait_until(lambda: deletions(b) == [rel], 20, "b's deletion after the restart")
    assert deletions(a) == []


def test_late_copy_of_a_deleted_epoch_is_deleted_too(raw):
    """A copy reported after its epoch was deleted, and after its holder
    had done that deletion (a push or fetch slower than the deletions), is
    not recorded as a copy; its holder is asked to delete the epoch again.
    Before, the copy stayed on that worker's disk for good."""
    r = raw(n_workers=2, world=2)
    code, _, det = r.report_checkpoint(0, 5)  # rank 1 never reports: never committed
    assert code == OK, det
    rel = r.epoch_rel(5)
    holder = r.ranks[1]
    code, _, det = r.report_ring_failure(r.ranks[0])
    assert code == OK, det
    r.wait_generation(2)

    def queued_on_holder():
        with sqlite3.connect(r.coord.db) as db:
            return db.execute("SELECT count(*) FROM epoch_deletions WHERE dir = ? AND "
                              "worker_id = ?", (rel, holder.id)).fetchone()[0]
    wait_until(queued_on_holder, 10, "the deletion queued on the holder")
    code, _, det = holder.call("Heartbeat", field_bytes(6, rel.encode()))
    assert code == OK, det
    assert queued_on_holder() == 0
    # The late copy: answered (its pusher need not retry), not recorded,
    # and queued for deletion on its holder.
    body = (field_varint(2, r.jid) + field_bytes(3, rel.encode())
            + field_bytes(4, r.file_msg("rank_0.bin", 1000, "xxh64:00000000000000aa")))
    code, _, det = holder.call("ReportReplica", body)
    assert code == OK, det
    assert queued_on_holder() == 1
    with sqlite3.connect(r.coord.db) as db:
        copies = db.execute("SELECT count(*) FROM checkpoint_copies WHERE job_id = ? AND "
                            "step = 5 AND gen = 1", (r.jid,)).fetchone()[0]
    assert copies == 0


def test_step_report_shares_checked_before_anything_is_stored(raw):
    """A step report's load balance plan (field 11, one count per rank)
    must have one count per rank, each at least 1, summing to the step's
    micro-batches (12 here); else the report is refused, naming the
    problem, and neither the step nor an event is stored. A good plan is
    stored with the step and logged by worker name."""
    r = raw(n_workers=2, world=2)
    w = r.ranks[0]

    def report(step, shares):
        body = r.head() + field_varint(4, step) + field_double(5, 2.5)
        for s in shares:
            body += field_varint(11, s)
        return w.call("ReportStep", body)

    for shares, why in (([12], "1 of them for a generation of 2 ranks"),
                        ([12, 0], "rank 1 has none"),
                        ([6, 5], "they sum to 11, a step has 12")):
        code, _, det = report(1, shares)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and why in det, (shares, code, det)
    assert job(r.coord, r.jid)["step"] == 0
    assert not [e for e in events(r.coord) if e["kind"] == "load_balance"]
    assert report(1, [9, 3])[0] == OK
    ev = [e["detail"] for e in events(r.coord) if e["kind"] == "load_balance"]
    assert ev == [f"from step 2, micro-batches per worker (by measured speed): "
                  f"{r.ranks[0].name} 9, {r.ranks[1].name} 3"], ev
    assert job(r.coord, r.jid)["step"] == 1


def test_queued_step_reports_come_in_one_call(raw):
    """Reports that queued up behind an unreachable coordinator come in one
    call (field 12, `later`): every step is stored, in one transaction, and
    judged in order (a spike among them rolls back). Later steps out of
    range or out of order refuse the whole report, naming the first bad
    one, and store nothing of it."""
    r = raw(steps=100, rollback={"enabled": True, "margin_steps": 0})
    w = r.ranks[0]

    def metrics(step, loss):
        return field_varint(1, step) + field_double(2, loss)

    def report(first, later, loss=2.5):
        body = r.head() + field_varint(4, first) + field_double(5, loss)
        for s, l in later:
            body += field_bytes(12, metrics(s, l))
        return w.call("ReportStep", body)

    def stored():
        with sqlite3.connect(r.coord.db) as db:
            return dict(db.execute("SELECT step, loss FROM steps WHERE job_id = ?", (r.jid,)))

    code, _, det = report(1, [(s, 2.0 + 1.0 / s) for s in range(2, 31)], loss=3.0)
    assert code == OK, det
    got = stored()
    assert sorted(got) == list(range(1, 31)) and got[30] == pytest.approx(2.0 + 1 / 30), got
    assert job(r.coord, r.jid)["step"] == 30
    for later, why in (([(33, 2.0), (32, 2.0)], "later step 32 does not follow step 33"),
                       ([(32, 2.0), (101, 2.0)], "step 101 out of range 1..100")):
        code, _, det = report(31, later)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and why in det, (later, code, det)
    assert max(stored()) == 30 and job(r.coord, r.jid)["step"] == 30
    # A spike in the middle of a batch: rolled back, as it would be alone.
    code, _, det = r.report_checkpoint(0, 30)
    assert code == OK, det
    code, reply, det = report(31, [(32, 50.0), (33, 50.0), (34, 50.0), (35, 2.0)], loss=2.03)
    assert code == OK, det
    assert dict(fields(reply)).get(1) == 3, reply  # COMMAND_ROLLBACK
    detail = wait_until(lambda: rollback_detail(r), 10, "rollback")
    assert "(step 30)" in detail, detail
    skips = [e["detail"] for e in events(r.coord, job=r.jid) if e["kind"] == "skip_range"]
    assert skips and skips[-1].startswith("data of steps 32.."), skips


def test_registrations_that_waited_behind_a_held_loop_are_shed(procs):
    """The loop is held (a registration waits for the database's lock, as
    behind a burst): registrations that waited over a second for it are
    refused as UNAVAILABLE, naming why, before they write anything; the
    one that held the loop, and each later try, registers."""
    coord = procs.coord(hb_ms=200, timeout_ms=60000)
    ch = grpc.insecure_channel(coord.grpc)
    stub = ch.unary_unary(REGISTER, request_serializer=None, response_deserializer=None)
    names = [f"w{i}" for i in range(5)]
    with db_locked(coord.db):
        calls = {n: stub.future(field_bytes(1, n.encode()) + field_bytes(3, b"cpu"), timeout=30)
                 for n in names}
        time.sleep(2.5)  # the stall: the lock is held this long
    errors = {n: f.exception() for n, f in calls.items()}
    ok = [n for n, e in errors.items() if e is None]
    assert len(ok) == 1, errors
    for n, e in errors.items():
        if e is not None:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, (n, e)
            assert "the coordinator is behind" in e.details(), e.details()
    with sqlite3.connect(coord.db) as db:
        stored = {n for (n,) in db.execute("SELECT name FROM workers")}
    assert stored == set(ok), stored
    metrics = http_get(coord.http_port, "/metrics")[2]
    assert "ztrain_coordinator_registrations_shed_total 4\n" in metrics, metrics
    for n in names:
        if n not in ok:
            code, _, det = call(ch, REGISTER, field_bytes(1, n.encode()) + field_bytes(3, b"cpu"))
            assert code == OK, det
    ch.close()
