"""Memory admission: a job is given only to workers that can hold a rank.

Workers say at registration how much memory they may use (zworker
--memory); the coordinator computes what one rank of a job needs at each
world size (engine/memplan.c: the ZeRO states of the stage, activations, the
process) and refuses a job no known worker could hold, makes a job wait
with the reason while too few can, and learns from a worker that ran out
of memory anyway. Real zcoord and zworker processes.
"""
import json
import os
import subprocess

import pytest

from ztest import (BIN, SANITIZE, byte_dataset, events, http_get, job, job_members, start_fleet, submit,
                   tiny_spec, wait_job, wait_until, workers_by_name)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=100_000)


def medium(train, val, stage, workers, steps=3, **kw):
    """About 1.7 M parameters: 40 MB of states at stage 0, about 150 MB a
    rank with the process itself."""
    spec = tiny_spec(train, val, steps, stage=stage, workers=workers, gbs=8, **kw)
    spec["model"].update(n_layer=2, n_embd=256, n_head=4, seq_len=32)
    return spec


def test_job_no_worker_could_hold_is_refused_at_submit(procs, tmp_path, data):
    train, val = data
    coord = start_fleet(procs, names=["small"], extra=("--threads", "1", "--memory", "150M"))
    spec = medium(train, val, stage=0, workers=1)
    path = tmp_path / "big.json"
    path.write_text(json.dumps(spec))
    r = subprocess.run([f"{BIN}/zctl", "--coordinator", coord.grpc, "submit", str(path)],
                       capture_output=True, text=True)
    assert r.returncode != 0, r.stdout
    assert "no worker could hold one rank" in r.stderr and "150.0 MiB of RAM" in r.stderr, r.stderr
    assert http_get(coord.http_port, "/v1/jobs")[2]["jobs"] == []
    assert workers_by_name(coord)["small"]["host_memory_bytes"] == 150 << 20
    # A worker that can hold it makes the same job admissible.
    start_fleet(procs, names=["large"], coord=coord)
    wait_job(coord, submit(coord, spec, tmp_path), timeout=120)


def test_job_waits_for_workers_that_fit_and_says_so(procs, tmp_path, data):
    train, val = data
    coord = start_fleet(procs, names=["big0", "tiny"], extra=("--threads", "1"))
    w = workers_by_name(coord)
    assert w["big0"]["host_memory_bytes"] > 1 << 30  # the machine's RAM by default
    # Restart "tiny" with a budget that cannot hold any rank of the job.
    coord.workers["tiny"].kill()
    wait_until(lambda: workers_by_name(coord)["tiny"]["state"] != "alive", 30, "tiny gone")
    start_fleet(procs, names=["tiny"], coord=coord,
                extra=("--threads", "1", "--memory", "140M"))
    jid = submit(coord, medium(train, val, stage=3, workers=2), tmp_path)
    wait_until(lambda: "waiting for 2 workers that can each hold one rank" in job(coord, jid)["message"],
               20, "the job to say what it waits for")
    msg = job(coord, jid)["message"]
    assert "at world size 2, ZeRO stage 3" in msg and "1 available" in msg, msg
    assert job(coord, jid)["state"] == "pending"
    start_fleet(procs, names=["big1"], coord=coord)
    wait_job(coord, jid, timeout=120)
    assert job_members(coord, jid, current_only=False) == {"big0", "big1"}


def test_worker_out_of_memory_fails_with_reason_and_is_not_asked_again(procs, tmp_path, data):
    """A worker whose real memory is below what it declared (here: an
    RLIMIT_DATA it cannot exceed) fails its rank with "out of memory"
    instead of being killed; the coordinator stops giving it such ranks and
    the job goes on without it."""
    if SANITIZE:
        pytest.skip("AddressSanitizer reserves terabytes of shadow memory, which the "
                    "RLIMIT_DATA of this test forbids")
    train, val = data
    coord = start_fleet(procs, names=["honest"])
    liar = procs.start("liar", ["prlimit", "--data=400000000", f"{BIN}/zworker",
                                "--coordinator", coord.grpc, "--name", "liar",
                                "--workdir", os.path.join(procs.tmp, "work", "liar"),
                                "--device", "cpu", "--threads", "1", "--memory", "8G",
                                "--data-root", procs.root, "--checkpoint-root", procs.root])
    wait_until(lambda: workers_by_name(coord).get("liar", {}).get("state") == "alive", 20,
               "liar alive")
    spec = tiny_spec(train, val, 2, stage=0, workers=1, max_workers=2, micro=1, gbs=2)
    spec["model"].update(n_layer=2, n_embd=1024, n_head=8, seq_len=16)  # 25 M parameters
    jid = submit(coord, spec, tmp_path)
    j = wait_job(coord, jid, timeout=180)
    oom = [e for e in events(coord, job=jid) if e["kind"] == "out_of_memory"]
    assert oom and "liar" in oom[0]["detail"], events(coord, job=jid)
    failed = [e for e in events(coord, job=jid) if e["kind"] == "rank_failed"]
    assert any("out of" in e["detail"] and "memory" in e["detail"] for e in failed), failed
    assert liar.alive()  # failed its rank, was not killed
    assert workers_by_name(coord)["liar"]["host_memory_bytes"] < 8 << 30
    assert j["world"] == 1
