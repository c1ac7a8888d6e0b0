"""Checkpoints: sharded epochs, committed only when complete, reshardable,
checksummed; what a crash mid-write or a flipped byte does.

Real zcoord and zworker processes, real files. The reference for every
comparison is an uninterrupted run of the same job.
"""
import glob
import json
import os
import re
import signal
import sqlite3

import pytest

from ztest import (byte_dataset, events, losses, start_fleet, submit, tiny_spec, wait_job, zctl,
                   wait_until, zctl_json)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=300_000)


def fleet(procs, n, env=None, hb=300, timeout=1500):
    coord = start_fleet(procs, n, hb_ms=hb, timeout_ms=timeout, env_by_name=env)
    return coord, list(coord.workers.values())


def ckpts(coord, jid):
    return zctl_json(coord.grpc, "checkpoints", str(jid))["checkpoints"]


def committed(coord, jid):
    return {c["step"]: c for c in ckpts(coord, jid) if c["state"] == "committed"}


def test_reshard_resume_equals_uninterrupted(procs, tmp_path, data):
    train, val = data
    coord, _ = fleet(procs, 4)
    root = str(tmp_path / "ckpt")
    # Uninterrupted reference: N=4, ZeRO 2, 60 steps, an epoch at step 30.
    a = tiny_spec(train, val, 60, stage=2, workers=4,
                  checkpoint={"dir": root, "every_steps": 30, "keep_last": 5})
    ja = submit(coord, a, tmp_path, "a.json")
    wait_job(coord, ja)
    ref = losses(coord, ja)
    epochs = committed(coord, ja)
    assert 30 in epochs and epochs[30]["world"] == 4
    d30 = epochs[30]["dir"]
    files = sorted(os.path.basename(p) for p in glob.glob(d30 + "/*"))
    assert files == ["manifest.json"] + [f"rank_{r}.{e}" for r in range(4) for e in ("bin", "json")]
    assert not glob.glob(d30 + "/*.tmp")
    man = json.load(open(d30 + "/manifest.json"))
    assert man["step"] == 30 and man["world"] == 4 and man["zero_stage"] == 2
    assert man["data_cursor"] == 30 * 24
    # Resume the step-30 state elsewhere: N=2 with ZeRO 3, and N=3 with ZeRO 1.
    for n, stage in ((2, 3), (3, 1)):
        b = tiny_spec(train, val, 60, stage=stage, workers=n,
                      checkpoint={"dir": str(tmp_path / f"ck{n}"), "load": d30})
        jb = submit(coord, b, tmp_path, f"b{n}.json")
        wait_job(coord, jb)
        got = losses(coord, jb)
        assert min(got) == 31, f"resumed job should start at step 31, got {min(got)}"
        for s in range(31, 61):
            assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), (n, stage, s, got[s], ref[s])


def test_kill9_during_checkpoint_write(procs, tmp_path, data):
    train, val = data
    # w2 dies (SIGKILL, from inside) half-way through writing its file of the
    # first epoch at step 20 or later (20, unless the ranks skipped it
    # together because one was still busy with step 10's).
    env = {"w2": {"ZT_FAULT_KILL_IN_CKPT_STEP": "20"}}
    coord, ws = fleet(procs, 3, env=env)
    root = str(tmp_path / "ckpt")
    spec = tiny_spec(train, val, 40, stage=1, workers=2, max_workers=3, gbs=24,
                     checkpoint={"dir": root, "every_steps": 10, "keep_last": 10})
    jid = submit(coord, spec, tmp_path)
    j = wait_job(coord, jid, timeout=120)
    assert not ws[2].alive() and ws[2].p.returncode == -signal.SIGKILL
    states = {(c["step"], c["generation"]): c["state"] for c in ckpts(coord, jid)}
    # The epoch w2 died in, of generation 1, was never committed (and is gone)...
    died = [s for (s, g), st in states.items() if g == 1 and s >= 20 and st != "committed"]
    assert died, states
    killed = min(died)
    assert states[(killed, 1)] in ("pending", "deleted"), states
    assert not os.path.exists(os.path.join(root, f"job_{jid}", f"step_{killed:08d}-g1")) or \
        states[(killed, 1)] == "pending"
    # ...and the next generation resumed from the last one committed before it.
    before = max(s for (s, g), st in states.items() if g == 1 and st == "committed" and s < killed)
    with sqlite3.connect(coord.db) as db:
        gens = db.execute("SELECT gen, world, start_step FROM generations WHERE job_id = ? "
                          "ORDER BY gen", (jid,)).fetchall()
    assert gens[0] == (1, 3, 0) and gens[1][2] == before and gens[1][1] == 2, (gens, states)
    # The loss sequence equals an uninterrupted run's (replayed steps count once).
    ref_spec = tiny_spec(train, val, 40, stage=0, workers=1)
    jr = submit(coord, ref_spec, tmp_path, "ref.json")
    wait_job(coord, jr)
    ref, got = losses(coord, jr), losses(coord, jid)
    assert sorted(got) == list(range(1, 41))
    for s in range(1, 41):
        assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), (s, got[s], ref[s])
    assert j["restarts"] >= 1


def flip_byte(path, at=None):
    with open(path, "r+b") as f:
        f.seek(0, 2)
        size = f.tell()
        pos = size // 2 if at is None else at
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x40]))


def test_corrupt_checkpoint_is_refused_naming_the_file(procs, tmp_path, data):
    train, val = data
    coord, _ = fleet(procs, 2)
    root = str(tmp_path / "ckpt")
    spec = tiny_spec(train, val, 30, stage=2, workers=2,
                     checkpoint={"dir": root, "every_steps": 10, "keep_last": 5})
    ja = submit(coord, spec, tmp_path, "a.json")
    wait_job(coord, ja)
    # The first epoch and the final one are always written (a periodic one
    # in between may be skipped while the last one's copies are in flight).
    epochs = committed(coord, ja)
    d10, d30 = epochs[10]["dir"], epochs[30]["dir"]
    victim = os.path.join(d10, "rank_1.bin")
    flip_byte(victim)
    # A job that starts from the damaged epoch fails with the file's name.
    b = tiny_spec(train, val, 30, stage=2, workers=2,
                  checkpoint={"dir": str(tmp_path / "b"), "load": d10})
    jb = submit(coord, b, tmp_path, "b.json")
    j = wait_job(coord, jb, states=("failed",))
    assert "rank_1.bin" in j["message"] and "checksum mismatch" in j["message"], j["message"]
    ev = [e for e in events(coord, job=jb) if e["kind"] == "checkpoint_corrupt"]
    assert ev and "rank_1.bin" in ev[0]["detail"]
    # Truncation and a mismatched model are refused too.
    flip_byte(victim)  # restore
    with open(os.path.join(d10, "rank_0.bin"), "r+b") as f:
        f.truncate(100)
    jc = submit(coord, b, tmp_path, "c.json")
    j = wait_job(coord, jc, states=("failed",))
    assert "rank_0.bin" in j["message"] and "truncated" in j["message"], j["message"]
    other = tiny_spec(train, val, 40, stage=2, workers=2,
                      checkpoint={"dir": str(tmp_path / "d"), "load": d30})
    other["model"]["n_embd"] = 64
    jd = submit(coord, other, tmp_path, "d.json")
    j = wait_job(coord, jd, states=("failed",))
    assert "manifest.json" in j["message"] and "mismatched" in j["message"], j["message"]


def damage_own_newest_epoch(procs, tmp_path, data, damage):
    """Runs a 400-step job on three workers until two epochs are committed,
    freezes them, applies damage(dir) to the newest epoch, kills a member and
    lets the job finish. Returns (coord, job id, final job, step of the epoch
    before the damaged one)."""
    train, val = data
    coord, ws = fleet(procs, 3)
    root = str(tmp_path / "ckpt")
    spec = tiny_spec(train, val, 400, stage=2, workers=2, max_workers=3, gbs=24,
                     checkpoint={"dir": root, "every_steps": 10, "keep_last": 10})
    spec["model"].update(n_embd=96, n_head=4, n_layer=3)
    jid = submit(coord, spec, tmp_path)
    wait_until(lambda: len(committed(coord, jid)) >= 2, 120, "two committed epochs")
    for w in ws:
        w.signal(signal.SIGSTOP)
    try:
        newest = max(committed(coord, jid).items())
        prev_step = max(s for s in committed(coord, jid) if s < newest[0])
        damage(newest[1]["dir"])
    finally:
        ws[0].kill()
        for w in ws[1:]:
            w.signal(signal.SIGCONT)
    j = wait_job(coord, jid, timeout=300)
    with sqlite3.connect(coord.db) as db:
        starts = [r[0] for r in db.execute("SELECT start_step FROM generations WHERE job_id = ? "
                                           "ORDER BY gen", (jid,))]
    assert prev_step in starts, (starts, prev_step, newest[0])
    assert j["step"] == 400
    return coord, jid


def test_corrupt_own_epoch_falls_back_to_previous(procs, tmp_path, data):
    coord, jid = damage_own_newest_epoch(
        procs, tmp_path, data, lambda d: flip_byte(os.path.join(d, "rank_0.bin")))
    ev = events(coord, job=jid)
    corrupt = [e for e in ev if e["kind"] == "checkpoint_corrupt"]
    assert corrupt and "rank_0.bin" in corrupt[0]["detail"] and "checksum" in corrupt[0]["detail"]


def rewrite_json(path, change):
    doc = json.load(open(path))
    change(doc)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


@pytest.mark.parametrize("tamper", ["index_range", "manifest_world", "index_dropped_range"])
def test_changed_metadata_is_caught_and_falls_back(procs, tmp_path, data, tamper):
    """Every byte a load depends on is checksummed at commit: a changed range
    in rank_R.json or a changed world size in manifest.json (both still valid
    JSON that would load without error) retires the epoch, and the job goes
    on from the previous one with the same losses as an untouched run."""
    train, val = data
    coord, ws = fleet(procs, 2)
    root = str(tmp_path / "ckpt")
    spec = tiny_spec(train, val, 40, stage=1, workers=2,
                     checkpoint={"dir": root, "every_steps": 10, "keep_last": 10})
    ja = submit(coord, spec, tmp_path, "a.json")
    wait_job(coord, ja)
    ref = losses(coord, ja)
    # The newest epoch before the final one is damaged (which periodic
    # epochs exist depends on the machine's load: one is skipped while the
    # last one's copies are in flight; step 10's, the first, always is).
    epochs = committed(coord, ja)
    mid = max(s for s in epochs if s < 40)
    dmid = epochs[mid]["dir"]
    if tamper == "index_range":
        rewrite_json(os.path.join(dmid, "rank_1.json"),
                     lambda d: d["ranges"][0].update(lo=d["ranges"][0]["lo"] + 1))
        culprit = "rank_1.json"
    elif tamper == "manifest_world":
        rewrite_json(os.path.join(dmid, "manifest.json"), lambda d: d.update(world=1))
        culprit = "manifest.json"
    else:
        rewrite_json(os.path.join(dmid, "rank_0.json"), lambda d: d["ranges"].pop())
        culprit = "rank_0.json"
    # A job resuming from the damaged epoch refuses it, naming the file...
    b = tiny_spec(train, val, 40, stage=1, workers=2,
                  checkpoint={"dir": str(tmp_path / "b"), "load": dmid})
    jb = submit(coord, b, tmp_path, "b.json")
    j = wait_job(coord, jb, states=("failed",))
    assert culprit in j["message"] and "corrupt checkpoint" in j["message"], j["message"]
    # ...and a job that falls back to the epoch before it still gets the
    # reference losses (from the start when the damaged one is the first).
    prev = max((s for s in epochs if s < mid), default=0)
    ck = {"dir": str(tmp_path / "c")}
    if prev:
        ck["load"] = epochs[prev]["dir"]
    c = tiny_spec(train, val, 40, stage=1, workers=2, checkpoint=ck)
    jc = submit(coord, c, tmp_path, "c.json")
    wait_job(coord, jc)
    got = losses(coord, jc)
    for s in range(prev + 1, 41):
        assert got[s] == ref[s], (s, got[s], ref[s])


def test_own_epoch_with_changed_index_is_retired(procs, tmp_path, data):
    coord, jid = damage_own_newest_epoch(
        procs, tmp_path, data,
        lambda d: rewrite_json(os.path.join(d, "rank_0.json"),
                               lambda x: x["ranges"][0].update(n=x["ranges"][0]["n"] - 1)))
    corrupt = [e for e in events(coord, job=jid) if e["kind"] == "checkpoint_corrupt"]
    assert corrupt and "rank_0.json" in corrupt[0]["detail"], corrupt
    assert "checkpoint_retired" in [e["kind"] for e in events(coord, job=jid)]


def test_load_of_an_unknown_epoch_is_refused(procs, tmp_path, data):
    train, val = data
    coord, _ = fleet(procs, 1)
    os.makedirs(str(tmp_path / "fake"), exist_ok=True)
    spec = tiny_spec(train, val, 10, checkpoint={"dir": str(tmp_path / "ck"),
                                                 "load": str(tmp_path / "fake")})
    path = tmp_path / "s.json"
    path.write_text(json.dumps(spec))
    from ztest import zctl
    r = zctl(coord.grpc, "submit", str(path), check=False)
    assert r.returncode == 1 and "checkpoint.load" in r.stderr
    assert "not a committed checkpoint epoch" in r.stderr, r.stderr


def test_final_step_is_checkpointed(procs, tmp_path, data):
    """A completed job ends with its last step committed, also when steps is not a multiple
    of the interval; the job completes only then, and says so. Loading a checkpoint at or
    past the last step is a job error, not a job that never ends."""
    train, val = data
    coord, _ = fleet(procs, 2)
    root = str(tmp_path / "ckpt")
    spec = tiny_spec(train, val, 45, stage=1, workers=2,
                     checkpoint={"dir": root, "every_steps": 20, "keep_last": 5})
    jid = submit(coord, spec, tmp_path)
    j = wait_job(coord, jid)
    epochs = committed(coord, jid)
    # Step 40's epoch may be skipped by design (step 20's copies still in
    # flight on a busy machine); the first and the final one are not.
    assert {20, 45} <= set(epochs) <= {20, 40, 45}, sorted(epochs)
    man = json.load(open(epochs[45]["dir"] + "/manifest.json"))
    assert man["step"] == 45 and man["world"] == 2
    assert j["checkpoint_step"] == 45 and "final checkpoint step 45 committed" in j["message"]
    row = [line for line in zctl(coord.grpc, "jobs").stdout.splitlines()
           if line.split()[0] == str(jid)][0]
    assert row.split()[5:7] == ["45/45", "45"], row
    # The final epoch resumes nothing: a job loading it fails at once, naming why.
    again = tiny_spec(train, val, 45, stage=1, workers=2,
                      checkpoint={"dir": str(tmp_path / "ck2"), "load": epochs[45]["dir"]})
    j2 = wait_job(coord, submit(coord, again, tmp_path, "again.json"), states=("failed",))
    assert "nothing left to train" in j2["message"]


def test_skipped_epochs_are_skipped_by_every_rank(procs, tmp_path, data):
    """Rank 0 reports its epochs late (fault injection), so periodic epochs
    are skipped while its previous one is still being reported. The ranks
    decide together: every epoch any rank wrote commits, and none is left
    pending on disk once the job completes."""
    train, val = data
    coord, ws = fleet(procs, 3)
    root = str(tmp_path / "ckpt")
    spec = tiny_spec(train, val, 60, stage=1, workers=3,
                     checkpoint={"dir": root, "every_steps": 2, "keep_last": 100})
    spec["fault_injection"] = {"delay_checkpoint_report_ms": 60}
    jid = submit(coord, spec, tmp_path, "slow.json")
    wait_job(coord, jid, timeout=180)
    logs = [w.output() for w in ws]
    assert any(re.search(r"checkpoint step \d+ skipped", out) for out in logs), logs[0][-3000:]
    # Checkpoints do not change the numbers of training: the same job
    # without the fault has the same losses.
    del spec["fault_injection"]
    spec["checkpoint"]["dir"] = str(tmp_path / "ref")
    jr = submit(coord, spec, tmp_path, "ref.json")
    wait_job(coord, jr, timeout=180)
    assert losses(coord, jid) == losses(coord, jr)
    states = {c["step"]: c["state"] for c in ckpts(coord, jid)}
    assert [s for s, st in states.items() if st != "committed"] == [], \
        (states, [e["detail"] for e in events(coord, job=jid) if "checkpoint" in e["kind"]])
    written = set()
    for out in logs:
        written |= {int(m) for m in re.findall(
            rf"checkpoint step (\d+) written in \d+ ms: \S*/job_{jid}/", out)}
    assert written and all(states.get(s) == "committed" for s in written), (written, states)
    on_disk = sorted(os.path.basename(p) for p in glob.glob(f"{root}/job_{jid}/step_*"))
    assert on_disk == [f"step_{s:08d}-g1" for s in sorted(states)], (on_disk, states)


def test_unreported_epochs_are_deleted_once_they_cannot_commit(procs, tmp_path, data):
    """An epoch directory no report named (its ranks wrote it while their
    reports could not reach the coordinator; a copy a store took but could
    not record; a fetch or write that never finished) is deleted once it
    can no longer commit, even when it appears after the job ended and its
    worker stays idle: the worker sends what it holds whenever an epoch
    directory of another job or generation appears, an empty or unfinished
    one as the directory itself. One under a job the coordinator does not
    know is not its to delete."""
    train, val = data
    coord, _ = fleet(procs, 1)
    root = str(tmp_path / "ckpt")
    spec = tiny_spec(train, val, 20, workers=1, checkpoint={"dir": root, "every_steps": 10})
    jid = submit(coord, spec, tmp_path)
    wait_job(coord, jid)
    planted = {"stale": (f"{root}/job_{jid}/step_00000015-g1", "rank_0.bin"),
               "empty": (f"{root}/job_{jid}/step_00000016-g1", None),
               "unfinished": (f"{root}/job_{jid}/step_00000017-g1", "rank_0.bin.tmp"),
               "foreign": (f"{root}/job_999/step_00000015-g1", "rank_0.bin")}
    for d, name in planted.values():
        os.makedirs(d)
        if name:
            with open(f"{d}/{name}", "wb") as f:
                f.write(b"\0" * 64)
    gone = [d for k, (d, _) in planted.items() if k != "foreign"]
    wait_until(lambda: not any(os.path.exists(d) for d in gone), 10,
               "the unreported epochs deleted while the worker is idle")
    assert os.path.isfile(f"{planted['foreign'][0]}/rank_0.bin")
    ks = list(committed(coord, jid).values())
    assert ks
    for k in ks:
        assert os.path.isfile(f"{k['dir']}/manifest.json"), k
