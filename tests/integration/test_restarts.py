"""Failures that repeat: no restart storms.

A deterministic error pauses the job after it came back once; transient
failures are retried with growing delays and a bounded budget; repeats are
one logbook row with a count; a checkpoint that cannot be written pauses
checkpointing, not training. Real zcoord and zworker processes, real files,
a real (small) tmpfs for the full disk.
"""
import os
import sqlite3
import subprocess

import pytest

from ztest import (byte_dataset, events, http_get, job, losses, start_fleet, submit, tiny_spec,
                   wait_job, wait_until)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=200_000)


def generations(coord, jid):
    with sqlite3.connect(coord.db) as db:
        return db.execute("SELECT gen, started_ms, reason FROM generations WHERE job_id = ? "
                          "ORDER BY gen", (jid,)).fetchall()


def kinds(coord, jid):
    return [e["kind"] for e in events(coord, job=jid)]


def metric(coord, name, jid):
    text = http_get(coord.http_port, "/metrics")[2]
    for line in text.splitlines():
        if line.startswith(f'{name}{{job_id="{jid}"}} '):
            return float(line.split()[1])
    raise AssertionError(f"{name} for job {jid} not in /metrics")


def test_same_data_error_twice_pauses_the_job(procs, tmp_path, data):
    """Tokens >= vocab_size fail the same step in every generation: after
    the second identical failure the job is paused with the reason, instead
    of re-forming without end."""
    train, val = data
    coord = start_fleet(procs, 2)
    spec = tiny_spec(train, val, 20, workers=2)
    spec["model"]["vocab_size"] = 100  # English bytes go up to 126
    jid = submit(coord, spec, tmp_path)
    j = wait_job(coord, jid, timeout=60, states=("paused",))
    assert "same local error twice at step 1" in j["message"], j
    assert ">= vocab_size 100" in j["message"], j
    assert len(generations(coord, jid)) == 2
    assert j["state"] == "paused"
    # Nothing more happens: the workers are idle, no generation forms.
    assert all(w["state"] == "alive" for w in http_get(coord.http_port, "/v1/workers")[2]["workers"])
    assert len(generations(coord, jid)) == 2


def test_transient_failures_back_off_then_pause(procs, tmp_path, data):
    """A ring that breaks in the first step of every generation: re-formed at
    once, then after 300, 600 ms..., and after max_failed_generations in a
    row the job is paused. The logbook holds each repeating kind once, with
    a count."""
    train, val = data
    coord = start_fleet(procs, 2)
    spec = tiny_spec(train, val, 20, workers=2)
    spec["elastic"].update(max_failed_generations=4, backoff_ms=300, max_backoff_ms=5000)
    spec["fault_injection"] = {"break_ring_at_step": 1}
    jid = submit(coord, spec, tmp_path)
    j = wait_job(coord, jid, timeout=90, states=("paused",))
    assert "4 generations in a row failed before completing a step" in j["message"], j
    assert "ring broken at step 1" in j["message"], j
    gens = generations(coord, jid)
    assert len(gens) == 4, gens
    gaps = [gens[i + 1][1] - gens[i][1] for i in range(3)]
    assert gaps[1] >= 300 and gaps[2] >= 600, gaps  # the backoff doubles
    ev = [e for e in events(coord, job=jid)]
    failed = [e for e in ev if e["kind"] == "rank_failed"]
    # Both ranks' reports count (the verdict on who is cut off waits for
    # them): one entry per rank, each with its count.
    assert len(failed) == 2 and all(f["count"] == 4 for f in failed), failed
    started = [e for e in ev if e["kind"] == "generation_started"]
    assert len(started) == 2 and started[1]["count"] == 3, started  # the first had another reason
    # A collapsed row keeps its first occurrence with its time, and the
    # latest with its own: no time is paired with another one's text.
    first, last = started[1]["detail"], started[1]["last_detail"]
    assert first.startswith("generation 2:") and last.startswith("generation 4:"), started[1]
    assert started[1]["last_ms"] - started[1]["t_ms"] >= 300 + 600, started[1]
    backoff = [e for e in ev if e["kind"] == "restart_backoff"]
    assert len(backoff) == 1 and backoff[0]["count"] == 2, backoff
    # zctl resume starts the budget afresh: four more generations, paused again.
    subprocess.run([os.path.join(os.environ.get("ZT_BIN", "build/bin"), "zctl"),
                    "--coordinator", coord.grpc, "resume", str(jid)], check=True,
                   capture_output=True)
    wait_until(lambda: len(generations(coord, jid)) == 8 and job(coord, jid)["state"] == "paused",
               90, "a second round of four generations")


def test_uncreatable_checkpoint_dir_pauses_checkpointing_not_training(procs, tmp_path, data):
    """checkpoint.dir is a regular file: every epoch fails to write. The
    generation goes on (no re-forms), /metrics raises the alert, and the job
    pauses once more than max_uncommitted_steps steps are at risk. The
    pause is retried by itself after 10 s, and when the writes fail again
    it pauses again with the next retry twice as far off."""
    train, val = data
    coord = start_fleet(procs, 2)
    blocker = tmp_path / "ckfile"
    blocker.write_text("not a directory")
    spec = tiny_spec(train, val, 200, workers=2,
                     checkpoint={"dir": str(blocker), "every_steps": 5,
                                 "max_uncommitted_steps": 22})
    jid = submit(coord, spec, tmp_path)
    j = wait_job(coord, jid, timeout=90, states=("paused",))
    assert "no checkpoint committed for 23 steps" in j["message"], j
    assert "Not a directory" in j["message"], j
    assert len(generations(coord, jid)) == 1
    ev = events(coord, job=jid)
    failed = [e for e in ev if e["kind"] == "checkpoint_failed"]
    assert len(failed) == 1 and failed[0]["count"] >= 4, failed
    assert [e["kind"] for e in ev].count("checkpointing_paused") == 1
    assert metric(coord, "ztrain_job_checkpointing_paused", jid) == 1
    assert metric(coord, "ztrain_job_steps_since_checkpoint", jid) == 23
    assert "retried by itself in 10 s (retry 1 of 6)" in j["message"], j
    j = wait_until(lambda: (lambda x: x if "retry 2 of 6" in x["message"] and
                            x["state"] == "paused" else None)(job(coord, jid)),
                   40, "the automatic retry, failing again")
    assert "retried by itself in 20 s" in j["message"], j
    assert len(generations(coord, jid)) == 2
    resumed = [e for e in events(coord, job=jid) if e["kind"] == "job_resumed"]
    assert len(resumed) == 1 and "retry 1 of 6" in resumed[0]["detail"], resumed


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_pauses_checkpointing_until_space_is_freed(procs, tmp_path, data, small_fs):
    """The checkpoint disk fills up: training goes on with the same losses,
    checkpointing resumes by itself once space is freed."""
    train, val = data
    coord = start_fleet(procs, 2)
    ref_spec = tiny_spec(train, val, 60, workers=2)
    ref = submit(coord, ref_spec, tmp_path, "ref.json")
    wait_job(coord, ref)
    filler = small_fs / "filler"
    with open(filler, "wb") as f:  # leaves about 64 KiB: less than one rank's file
        try:
            f.write(b"\0" * (2 << 20))
        except OSError:
            pass
    os.truncate(filler, (2 << 20) - (64 << 10))
    spec = tiny_spec(train, val, 60, workers=2,
                     checkpoint={"dir": str(small_fs / "ck"), "every_steps": 5,
                                 "max_uncommitted_steps": 1000})
    spec["comm"] = {"timeout_ms": 10000}
    jid = submit(coord, spec, tmp_path)
    wait_until(lambda: "checkpointing_paused" in kinds(coord, jid), 60, "checkpointing paused")
    assert metric(coord, "ztrain_job_checkpointing_paused", jid) == 1
    assert "checkpointing paused" in job(coord, jid)["message"]
    assert "No space left on device" in job(coord, jid)["message"]
    os.unlink(filler)
    wait_until(lambda: "checkpointing_resumed" in kinds(coord, jid), 60, "checkpointing resumed")
    # The job's message no longer says checkpointing is paused.
    j = job(coord, jid)
    assert j["state"] != "running" or "checkpointing paused" not in j["message"], j
    wait_job(coord, jid, timeout=120)
    assert "checkpointing_resumed" in kinds(coord, jid)
    assert metric(coord, "ztrain_job_checkpointing_paused", jid) == 0
    assert len(generations(coord, jid)) == 1
    assert losses(coord, jid) == losses(coord, ref)
    # Failed epochs left nothing behind.
    committed = {e["detail"] for e in events(coord, job=jid) if e["kind"] == "checkpoint_committed"}
    left = {os.path.join(str(small_fs / "ck"), f"job_{jid}", d)
            for d in os.listdir(small_fs / "ck" / f"job_{jid}")}
    assert left <= committed, (left, committed)
