"""Recovery from memory (docs/zero.md): a worker killed with SIGKILL at
ZeRO stage 0 costs no step. The survivors keep the whole model state in
memory, the next generation resumes at the step that was interrupted with
no epoch read, the steps the lost rank 0 had not reported yet are reported
again by the new one, and the loss series equals a failure-free run's bit
for bit.
"""
import re
import sqlite3

import pytest

from ztest import (byte_dataset, events, job, losses, start_fleet, submit, tiny_spec, wait_job,
                   wait_until)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=300_000)


def rank_of(coord, jid, rank):
    """The name of the worker at `rank` in the job's current generation."""
    with sqlite3.connect(coord.db) as db:
        row = db.execute("SELECT w.name FROM members m JOIN jobs j ON j.id = m.job_id AND "
                         "j.generation = m.gen JOIN workers w ON w.id = m.worker_id "
                         "WHERE m.job_id = ? AND m.rank = ?", (jid, rank)).fetchone()
    return row[0] if row else None


def kill_at(coord, ws, jid, rank, past):
    """Kills the worker at `rank` once the job has reported a step past
    `past`; the step the coordinator had then."""
    wait_until(lambda: job(coord, jid)["step"] > past and job(coord, jid)["state"] == "running",
               120, f"step {past}")
    name = rank_of(coord, jid, rank)
    seen = job(coord, jid)["step"]
    ws[name].kill()
    return name, seen


def test_kill9_at_stage0_resumes_from_memory(procs, tmp_path, data):
    """Two kills: the first of rank 0, whose place a worker that was idle
    takes (it holds nothing: a survivor sends it the state and the kept
    step reports), the second of another rank. The survivors hold the
    interrupted step, or some the step before when its gradient gathers
    were cut off on them: the newest is sent to the others."""
    train, val = data
    names = ["a", "b", "c", "d", "e"]
    coord = start_fleet(procs, names=names, hb_ms=300, timeout_ms=1500)
    ws = coord.workers
    # Epochs every 50 steps: the kills at ~62 and ~118 fall mid-interval,
    # where a restart from the epoch would train 12 and 18 steps again.
    spec = tiny_spec(train, val, 160, stage=0, workers=2, max_workers=4,
                     checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 50})
    jid = submit(coord, spec, tmp_path)
    wait_until(lambda: job(coord, jid)["world"] == 4, 60, "4 ranks")
    first, seen1 = kill_at(coord, ws, jid, 0, 61)   # rank 0: its unsent reports go with it
    second, seen2 = kill_at(coord, ws, jid, 2, 117)
    j = wait_job(coord, jid, timeout=300)
    assert j["restarts"] == 2, j

    ev = events(coord, job=jid)
    assert not [e for e in ev if e["kind"] == "resumed_from_epoch"], ev
    # The logbook collapses an event of the previous one's shape into its
    # row (count, last_detail).
    rows = [e for e in ev if e["kind"] == "resumed_from_memory"]
    mem = [d for e in rows for d in [e["detail"]] + [e.get("last_detail", "")] * (e["count"] > 1)]
    assert sum(e["count"] for e in rows) == 2, rows
    assert len(mem) == 2 and "generation 2 " in mem[0] and "generation 3 " in mem[1], mem
    # The survivors hold the step or, when the last step's gathers were cut
    # off on some of them (its update is all or none), the step before.
    assert re.search(r"[123] of 4 ranks hold it, rank \d sends it to the others", mem[0]), mem
    assert re.search(r"every rank holds it|[12] of 3 ranks hold it", mem[1]), mem
    resumed = [int(re.search(r"state after step (\d+)", d).group(1)) for d in mem]
    # The step the next generation runs is the one that was interrupted.
    # Rank 0 reports a step once its update is queued, and with overlap
    # the update's gradient gathers run behind the next step's start: a
    # kill inside them cuts that update off on every survivor (it is all
    # or none, docs/zero.md), so the last reported step may be the one
    # that runs again. No step before it is.
    assert seen1 - 1 <= resumed[0] < 100 and seen2 - 1 <= resumed[1] < 150, \
        (seen1, seen2, resumed)
    with sqlite3.connect(coord.db) as db:
        starts = [r[0] for r in db.execute("SELECT start_step FROM generations WHERE job_id = ? "
                                           "ORDER BY gen", (jid,))]
    assert starts == [0] + resumed, (starts, resumed)
    for n, w in ws.items():
        if n in (first, second):
            continue
        out = w.output()
        assert "loaded checkpoint" not in out, out[-3000:]
        assert out.count("resumed from memory") == 2, out[-3000:]
    sent = [n for n, w in ws.items() if re.search(r"step \d+ that rank \d sent", w.output())]
    assert len(sent) >= 3, sent  # every rank of generation 2 but the one that sent

    # Every step once, each equal to a failure-free run's bit for bit.
    got = losses(coord, jid)
    ref = dict(spec, elastic={"min_workers": 1, "max_workers": 1})
    ref.pop("checkpoint")
    rid = submit(coord, ref, tmp_path, "reference.json")
    wait_job(coord, rid, timeout=300)
    want = losses(coord, rid)
    assert sorted(got) == sorted(want) == list(range(1, 161))
    diff = [(s, got[s], want[s]) for s in want if got[s] != want[s]]
    assert not diff, (resumed, diff[:5], len(diff))
