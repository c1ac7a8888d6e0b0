"""Loss spikes: detection, automatic rollback, data skip, LR cooldown, the
rollback budget, and the logbook; with real processes and a real spike
(the test-only fault_injection knob multiplies the LR for a step range).
"""
import glob
import math
import os
from array import array

from ztest import (byte_dataset, events, job, losses, start_fleet, submit, tiny_spec,
                   wait_job, wait_until, zctl, zctl_json)

import pytest


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=300_000)


def fleet(procs, n=2):
    return start_fleet(procs, n)


def spiky_spec(train, val, tmp_path, steps=300, scale=100.0, at=(150, 153), **rb):
    rollback = {"enabled": True, "window": 50, "threshold": 6, "patience": 3,
                "margin_steps": 5, "skip_steps": 10, "lr_factor": 0.5, "cooldown_steps": 40,
                "max_rollbacks": 3, "per_steps": 1000}
    rollback.update(rb)
    return tiny_spec(train, val, steps, stage=2, workers=2,
                     checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 10,
                                 "keep_last": 30},
                     rollback=rollback,
                     fault_injection={"lr_scale": scale, "from_step": at[0], "to_step": at[1]})


def kinds(evs):
    return [e["kind"] for e in evs]


def test_spike_detected_rolled_back_and_recovered(procs, tmp_path, data):
    train, val = data
    coord = fleet(procs)
    jid = submit(coord, spiky_spec(train, val, tmp_path), tmp_path)
    j = wait_job(coord, jid, timeout=300)
    ev = events(coord, job=jid)
    k = kinds(ev)
    # The event sequence: spike, rollback, skip range, LR change, new generation.
    assert "spike" in k, [(e["kind"], e["detail"][:100]) for e in ev]
    i = k.index("spike")
    assert k[i:i + 4] == ["spike", "rollback", "skip_range", "lr_change"], k[i:]
    assert "generation_started" in k[i + 4:]
    spike = ev[i]["detail"]
    first = int(spike.split("from step ")[1].split(":")[0])
    # Detected within `patience` steps of the fault's first step.
    assert 150 <= first <= 153 and "loss" in spike
    rb = ev[i + 1]["detail"]
    to = int(rb.split("(step ")[1].rstrip(")"))
    assert to <= first - 1 - 5 and to % 10 == 0, rb  # margin_steps, an epoch boundary
    assert "skipped" in ev[i + 2]["detail"] and "x0.5" in ev[i + 3]["detail"]
    # Recovered: the final loss is at or below the pre-spike level.
    ls = losses(coord, jid)
    pre = sum(ls[s] for s in range(first - 10, first)) / 10
    assert ls[300] <= pre + 0.05, (ls[300], pre)
    assert j["state"] == "completed"
    # The metrics of the replayed steps are the post-rollback ones.
    assert max(ls[s] for s in range(first, first + 20)) < pre + 1.0
    # The readable logbook and the run report.
    text = zctl(coord.grpc, "events", "--job", str(jid)).stdout
    assert "rollback" in text and "skip_range" in text


def finite_checkpoints(root):
    n = 0
    for binf in glob.glob(os.path.join(root, "job_*", "step_*", "rank_*.bin")):
        vals = array("f", open(binf, "rb").read())
        assert all(math.isfinite(v) for v in vals), binf
        n += 1
    return n


def test_nan_never_reaches_a_committed_checkpoint(procs, tmp_path, data):
    train, val = data
    coord = fleet(procs)
    spec = spiky_spec(train, val, tmp_path, steps=200, scale=1e12, at=(100, 100))
    jid = submit(coord, spec, tmp_path)
    wait_job(coord, jid, timeout=300)
    ev = events(coord, job=jid)
    spikes = [e for e in ev if e["kind"] == "spike"]
    assert spikes, kinds(ev)
    committed = [c for c in zctl_json(coord.grpc, "checkpoints", str(jid))["checkpoints"]
                 if c["state"] == "committed"]
    assert committed
    assert finite_checkpoints(str(tmp_path / "ckpt")) > 0
    assert all(math.isfinite(v) for v in losses(coord, jid).values())


def test_repeated_spikes_pause_the_job(procs, tmp_path, data):
    train, val = data
    coord = fleet(procs)
    spec = spiky_spec(train, val, tmp_path, steps=300, scale=60.0, max_rollbacks=2,
                      lr_factor=1.0)
    spec["fault_injection"]["repeat"] = True  # the spike comes back after each rollback
    jid = submit(coord, spec, tmp_path)
    j = wait_job(coord, jid, timeout=300, states=("paused", "completed"))
    assert j["state"] == "paused", [e["kind"] for e in events(coord, job=jid)]
    assert "rollbacks within" in j["message"] and "max_rollbacks 2" in j["message"], j["message"]
    assert "zctl resume" in j["message"]
    k = kinds(events(coord, job=jid))
    assert k.count("rollback") == 2 and k[-1] == "job_paused", k
    # zctl resume continues from the last good checkpoint (the spike comes
    # back, by construction, and the job pauses again).
    out = zctl(coord.grpc, "resume", str(jid)).stdout
    assert "resumed" in out
    wait_until(lambda: job(coord, jid)["state"] in ("running", "reconfiguring", "paused"), 30,
               "resumed")
    assert "job_resumed" in kinds(events(coord, job=jid))


def test_no_false_positive_on_a_clean_run(procs, tmp_path, data):
    train, val = data
    coord = fleet(procs)
    spec = tiny_spec(train, val, 1000, stage=1, workers=2,
                     checkpoint={"dir": str(tmp_path / "ckpt"), "every_steps": 100})
    spec["rollback"] = {"enabled": True}  # every other setting at its default
    jid = submit(coord, spec, tmp_path)
    wait_job(coord, jid, timeout=600)
    k = kinds(events(coord, job=jid))
    assert "spike" not in k and "rollback" not in k, k
