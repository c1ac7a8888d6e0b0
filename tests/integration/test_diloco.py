"""The sync modes (docs/engine.md): DiLoCo (sync.mode "diloco",
engine/diloco.c), real zworkers under zcoord, each a group of its own that
syncs only every inner_steps steps; and compressed gradients
(sync.compression) in DiLoCo and in synchronous training.

The outer step is checked against the paper's update rule computed here,
from the epochs' files: a sync step's epoch holds every group's inner
parameters from before the sync, the outer parameters and the outer
momentum (engine/diloco.h). Failures in the middle of a round and in the
middle of the outer step resume from the last sync's epoch, bit for bit.
"""
import json
import os
import re

import numpy as np
import pytest

from ztest import (byte_dataset, events, http_get, job, job_members, losses, start_fleet, submit,
                   tiny_spec, wait_job, wait_until, zctl_json)

H, LR, MU = 4, 0.7, 0.9


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=200_000)


def diloco_spec(train, val, steps, workers, root, every=H, compression="none", **extra):
    spec = tiny_spec(train, val, steps, 0, workers,
                     checkpoint={"dir": root, "every_steps": every, "keep_last": 10}, **extra)
    spec["sync"] = {"mode": "diloco", "inner_steps": H, "compression": compression,
                    "outer_optimizer": {"lr": LR, "momentum": MU, "nesterov": True}}
    return spec


def committed(coord, jid):
    cks = zctl_json(coord.grpc, "checkpoints", str(jid))["checkpoints"]
    return {c["step"]: c["dir"] for c in cks if c["state"] == "committed"}


def read_epoch(d):
    """{unit: (p, m, v)} over every rank file of the epoch in d, and the
    manifest."""
    man = json.load(open(os.path.join(d, "manifest.json")))
    units = {}
    for r in range(man["world"]):
        idx = json.load(open(os.path.join(d, f"rank_{r}.json")))
        raw = np.fromfile(os.path.join(d, idx["file"]), dtype=np.float32)
        for rg in idx["ranges"]:
            u, lo, n, off = rg["unit"], rg["lo"], rg["n"], rg["offset"] // 4
            p, m, v = (raw[off + k * n: off + (k + 1) * n] for k in range(3))
            units.setdefault(u, []).append((lo, p, m, v))
    out = {}
    for u, parts in units.items():
        parts.sort(key=lambda x: x[0])
        assert [x[0] for x in parts] == sorted(set(x[0] for x in parts)), f"unit {u} overlaps"
        out[u] = tuple(np.concatenate([x[k] for x in parts]) for k in (1, 2, 3))
    return man, out


def int8_round_trip(deltas):
    """What engine/quant.c's int8 encoding delivers of each unit's values:
    the units laid out as the worker holds them (each padded with zeros to
    a multiple of 8), blocks of 256 with a scale max|x| / 127 each."""
    sizes = [len(x) for x in deltas]
    flat = np.concatenate([np.pad(x, (0, -len(x) % 8)) for x in deltas]).astype(np.float32)
    out = np.zeros_like(flat)
    for b in range(0, len(flat), 256):
        x = flat[b:b + 256]
        scale = np.float32(np.max(np.abs(x))) / np.float32(127)
        q = np.clip(np.rint(x / scale), -127, 127) if scale > 0 else np.zeros_like(x)
        out[b:b + 256] = q.astype(np.float32) * scale
    res, at = [], 0
    for n in sizes:
        res.append(out[at:at + n])
        at += n + (-n % 8)
    return res


def outer_rule(prev, cur, groups, units, nesterov=True, compression="none"):
    """The outer parameters and momentum after the sync that `cur` holds,
    from the paper's rule (PyTorch's SGD semantics) on prev's outer state
    and cur's inner parameters, in fp32; with int8 compression, each
    group's pseudo-gradient as the encoding delivers it."""
    want_p, want_m = {}, {}
    deltas = [[prev[u][0] - cur[units * (1 + g) + u][0] for u in range(units)]
              for g in range(groups)]
    if compression == "int8":
        deltas = [int8_round_trip(d) for d in deltas]
    for u in range(units):
        outer, mom = prev[u][0], prev[u][1]
        delta = np.zeros_like(outer)
        for g in range(groups):
            delta = delta + deltas[g][u]
        delta = delta * np.float32(1.0 / groups)
        m = np.float32(MU) * mom + delta
        step = delta + np.float32(MU) * m if nesterov else m
        want_p[u], want_m[u] = outer - np.float32(LR) * step, m
    return want_p, want_m


def close(a, b):
    return np.allclose(a, b, rtol=1e-5, atol=1e-6)


LLAMA = {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32,
         "intermediate_size": 64, "seq_len": 32, "vocab_size": 257}


@pytest.mark.parametrize("workers,compression,arch",
                         [(2, "none", "gpt2"), (4, "none", "gpt2"), (3, "int8", "gpt2"),
                          (2, "none", "llama")])
def test_outer_step_is_the_papers(procs, tmp_path, data, workers, compression, arch):
    """Every sync's epoch against the rule: the groups' inner parameters
    (which differ: each trained on its own micro-batches) averaged into a
    pseudo-gradient, Nesterov momentum, the outer LR. The plain-momentum
    rule must not fit, so the check can tell them apart; with int8
    compression, neither may the uncompressed rule."""
    train, val = data
    coord = start_fleet(procs, workers)
    root = str(tmp_path / "ck")
    # A periodic epoch is skipped while the last one's copies are still
    # being pushed (trainer.c): the steps are slowed so that most are
    # written, and every pair of epochs one round apart is checked.
    spec = diloco_spec(train, val, 16, workers, root, compression=compression, gbs=12 * workers,
                       fault_injection={"slow_rank": 0, "slow_micro_ms": 10})
    if arch == "llama":
        spec["model"] = dict(LLAMA)
    jid = submit(coord, spec, tmp_path, "d.json")
    assert wait_job(coord, jid, timeout=120)["step"] == 16
    eps = committed(coord, jid)
    pairs = [(a, a + H) for a in sorted(eps) if a + H in eps]
    assert 16 in eps and pairs, eps
    got = losses(coord, jid)
    assert sorted(got) == list(range(1, 17)) and all(np.isfinite(list(got.values())))
    assert got[16] < got[1]
    for a, b in pairs:
        _, prev = read_epoch(eps[a])
        man, cur = read_epoch(eps[b])
        dl = man["diloco"]
        assert dl["groups"] == workers and dl["inner_steps"] == H and man["world"] == workers
        U = dl["units"]
        assert sorted(cur) == list(range(U * (1 + workers))), "real units, then each group's"
        inner0 = cur[U][0]
        assert any(not np.array_equal(cur[U * (1 + g)][0], inner0) for g in range(1, workers)), \
            "every group trained the same model"
        want_p, want_m = outer_rule(prev, cur, workers, U, compression=compression)
        for u in range(U):
            assert close(cur[u][0], want_p[u]), f"epoch {b} unit {u}: outer parameters"
            assert close(cur[u][1], want_m[u]), f"epoch {b} unit {u}: outer momentum"
            assert not np.any(cur[u][2]), "v of the outer units is zero"
        plain, _ = outer_rule(prev, cur, workers, U, nesterov=False, compression=compression)
        assert not all(close(cur[u][0], plain[u]) for u in range(U)), "the check cannot tell"
        if compression != "none":
            exact, _ = outer_rule(prev, cur, workers, U)
            assert not all(close(cur[u][0], exact[u]) for u in range(U)), "not compressed"


def test_resume_mid_round_and_mid_outer_step_is_bit_identical(procs, tmp_path, data):
    """A ring broken before the outer step of step 8 (first generation
    only), and then a worker killed in the middle of a round (SIGKILL; a
    spare takes its place): each time the job resumes from the last sync's
    epoch on two groups, and every loss equals an uninterrupted run's."""
    train, val = data
    coord = start_fleet(procs, 3)
    ref = submit(coord, diloco_spec(train, val, 16, 2, str(tmp_path / "ref")), tmp_path, "r.json")
    assert wait_job(coord, ref, timeout=120)["step"] == 16
    want = losses(coord, ref)

    spec = diloco_spec(train, val, 16, 2, str(tmp_path / "ck"),
                       fault_injection={"break_ring_before_update_at_step": 8,
                                        "slow_rank": 0, "slow_micro_ms": 30})
    jid = submit(coord, spec, tmp_path, "f.json")
    # The first generation fails at step 8's sync and the second resumes
    # from step 4; once it has trained past step 8, one of its workers
    # dies (6 micro-batches of 30 ms a step). A periodic epoch may be
    # skipped by design (the last one's copies still in flight), so the
    # wait is for the second generation's progress, not for one epoch:
    # the job resumes from whichever epoch is newest, bit for bit.
    wait_until(lambda: job(coord, jid)["generation"] >= 2 and job(coord, jid)["step"] >= 9, 120,
               "the second generation past step 8")
    victim = sorted(job_members(coord, jid))[0]
    coord.workers[victim].kill()
    j = wait_job(coord, jid, timeout=180)
    assert j["step"] == 16 and j["generation"] >= 3, j
    assert victim not in job_members(coord, jid)
    got = losses(coord, jid)
    assert sorted(got) == list(range(1, 17))
    for s in range(1, 17):
        assert got[s] == want[s], f"step {s}: {got[s]!r} after failures, {want[s]!r} without"


def test_a_group_that_joins(procs, tmp_path, data):
    """One group trains; a second worker registers and the job scales up
    at the next sync (the checkpoint-now epoch is written where the groups
    meet). The new group starts from the outer parameters and the inner
    moments of group 0, and the two train on to the end."""
    train, val = data
    coord = start_fleet(procs, 1)
    spec = diloco_spec(train, val, 40, 1, str(tmp_path / "ck"), every=20,
                       fault_injection={"slow_rank": 0, "slow_micro_ms": 15})
    spec["elastic"] = {"min_workers": 1, "max_workers": 2}
    jid = submit(coord, spec, tmp_path, "j.json")
    wait_until(lambda: job(coord, jid)["step"] >= 2, 60, "training on one group")
    start_fleet(procs, names=["w1"], coord=coord)
    j = wait_job(coord, jid, timeout=180)
    assert j["step"] == 40 and len(job_members(coord, jid)) == 2, j
    eps = committed(coord, jid)
    assert j["generation"] >= 2 and all(s % H == 0 for s in eps), (j, eps)
    man, cur = read_epoch(eps[40])
    assert man["diloco"]["groups"] == 2
    logs = "".join(w.output() for w in coord.workers.values())
    assert "diloco: group 1 of 2 starts from the inner state of group 0 of the epoch's 1" in logs
    got = losses(coord, jid)
    assert sorted(got) == list(range(1, 41)) and got[40] < got[1]
    # Export reads the real units: the synced model of the last step.
    r = zctl_json(coord.grpc, "export", str(jid), "--out", str(tmp_path / "export"))
    assert r["step"] == 40 and r["checkpoint"] == eps[40]
    assert os.path.getsize(tmp_path / "export" / "model.safetensors") == r["model_bytes"]


@pytest.mark.parametrize("stage,workers", [(0, 2), (1, 3), (2, 2), (3, 3)])
def test_sync_int8_gradients(procs, tmp_path, data, stage, workers):
    """sync.compression "int8" in synchronous training: the gradient of
    every other rank reaches its owner as int8 blocks, once a step at
    stages 0-1 (and stage 0's gathered gradient travels so too), every
    micro-step at stages 2-3. The losses follow the exact run's within 1%
    without equalling it, and a second run reproduces the first bit for
    bit."""
    train, val = data
    coord = start_fleet(procs, workers)
    base = tiny_spec(train, val, 24, stage, workers, gbs=12 * workers)
    rid = submit(coord, base, tmp_path, "exact.json")
    assert wait_job(coord, rid, timeout=120)["step"] == 24
    exact = losses(coord, rid)
    runs = []
    for i in range(2):
        spec = dict(base, sync={"compression": "int8"})
        jid = submit(coord, spec, tmp_path, f"int8-{i}.json")
        assert wait_job(coord, jid, timeout=120)["step"] == 24
        runs.append(losses(coord, jid))
    got = runs[0]
    assert runs[1] == got, "int8 runs differ"
    assert got != exact, "nothing was compressed"
    assert abs(got[24] - exact[24]) <= 0.01 * exact[24], (got[24], exact[24])
    assert got[24] < got[1]


def test_overlapped_rounds_resume_bit_identical(procs, tmp_path, data):
    """sync.overlap_steps: a round's all-reduce runs while the groups train
    on and lands 2 steps later (rounds before an epoch wait for it). The
    trajectory differs from waiting, and a ring broken under an overlapped
    all-reduce (first generation) resumes from the last epoch to the same
    losses as an undisturbed run."""
    train, val = data
    coord = start_fleet(procs, 2)
    spec = diloco_spec(train, val, 24, 2, str(tmp_path / "w"), every=8)
    wid = submit(coord, spec, tmp_path, "wait.json")
    assert wait_job(coord, wid, timeout=120)["step"] == 24
    waited = losses(coord, wid)
    spec = diloco_spec(train, val, 24, 2, str(tmp_path / "o"), every=8)
    spec["sync"]["overlap_steps"] = 2
    oid = submit(coord, spec, tmp_path, "overlap.json")
    assert wait_job(coord, oid, timeout=120)["step"] == 24
    want = losses(coord, oid)
    assert want != waited and want[24] < want[1]
    # Step 12 ends an overlapped round (12 is no epoch's step): its
    # all-reduce fails on its thread and the landing at step 14 says so.
    spec = diloco_spec(train, val, 24, 2, str(tmp_path / "f"), every=8,
                       fault_injection={"break_ring_before_update_at_step": 12})
    spec["sync"]["overlap_steps"] = 2
    fid = submit(coord, spec, tmp_path, "fail.json")
    j = wait_job(coord, fid, timeout=120)
    assert j["step"] == 24 and j["generation"] >= 2, j
    assert losses(coord, fid) == want
    logs = "".join(w.output() for w in coord.workers.values())
    assert "training failed at step 14: DiLoCo: the pseudo-gradient's all-reduce" in logs


def test_int4_error_feedback_resumes_bit_identical(procs, tmp_path, data):
    """sync.compression "int4": each group keeps what its encoding left out
    (error feedback) and adds it to its next pseudo-gradient. The residual
    is in every epoch (units U (1 + G + g) + u), and a ring broken before
    step 12's outer step resumes from step 8 with it, to an undisturbed
    run's losses; int4 with its feedback stays near the fp32 run."""
    train, val = data
    coord = start_fleet(procs, 2)
    exact = submit(coord, diloco_spec(train, val, 16, 2, str(tmp_path / "x")), tmp_path, "x.json")
    assert wait_job(coord, exact, timeout=120)["step"] == 16
    ref = submit(coord, diloco_spec(train, val, 16, 2, str(tmp_path / "r"), compression="int4"),
                 tmp_path, "r.json")
    assert wait_job(coord, ref, timeout=120)["step"] == 16
    want, fp32 = losses(coord, ref), losses(coord, exact)
    assert want != fp32 and abs(want[16] - fp32[16]) <= 0.02 * fp32[16], (want[16], fp32[16])
    eps = committed(coord, ref)
    man, units = read_epoch(eps[16])
    U, G = man["diloco"]["units"], 2
    assert man["diloco"]["error_feedback"] == 1
    assert sorted(units) == list(range(U * (1 + 2 * G)))
    assert any(np.any(units[U * (1 + G) + u][0]) for u in range(U)), "no residual kept"
    spec = diloco_spec(train, val, 16, 2, str(tmp_path / "f"), compression="int4",
                       fault_injection={"break_ring_before_update_at_step": 12})
    fid = submit(coord, spec, tmp_path, "f.json")
    j = wait_job(coord, fid, timeout=120)
    assert j["step"] == 16 and j["generation"] >= 2, j
    assert losses(coord, fid) == want


def test_rollback_on_outer_steps(procs, tmp_path, data):
    """A loss spike in DiLoCo (the inner LR x100 for steps 150-153 in
    every group) reaches the coordinator when the groups meet at step 160;
    it rolls the job back to an epoch where they met, skips the data and
    lowers the LR, and the job recovers."""
    train, val = data
    coord = start_fleet(procs, 2)
    spec = diloco_spec(train, val, 300, 2, str(tmp_path / "ck"), every=10,
                       fault_injection={"lr_scale": 100.0, "from_step": 150, "to_step": 153})
    spec["sync"]["inner_steps"] = 10
    spec["checkpoint"]["keep_last"] = 30
    spec["rollback"] = {"enabled": True, "window": 50, "threshold": 6, "patience": 3,
                        "margin_steps": 5, "skip_steps": 10, "lr_factor": 0.5,
                        "cooldown_steps": 40, "max_rollbacks": 3, "per_steps": 1000}
    jid = submit(coord, spec, tmp_path, "spike.json")
    j = wait_job(coord, jid, timeout=300)
    ev = events(coord, job=jid)
    k = [e["kind"] for e in ev]
    assert "spike" in k, [(e["kind"], e["detail"][:100]) for e in ev]
    i = k.index("spike")
    assert k[i:i + 4] == ["spike", "rollback", "skip_range", "lr_change"], k[i:]
    first = int(ev[i]["detail"].split("from step ")[1].split(":")[0])
    assert 150 <= first <= 154, ev[i]["detail"]
    to = int(ev[i + 1]["detail"].split("(step ")[1].rstrip(")"))
    assert to <= first - 1 - 5 and to % 10 == 0, ev[i + 1]["detail"]  # where the groups met
    ls = losses(coord, jid)
    pre = sum(ls[s] for s in range(first - 10, first)) / 10
    assert j["state"] == "completed" and ls[300] <= pre + 0.05, (ls[300], pre)


def test_corrupt_compressed_block_is_refused(procs, tmp_path, data):
    """A pseudo-gradient that arrives with a value out of range (int8's
    -128, from the last rank at step 8 in the first generation) fails the
    sync on every group with a message naming the block and its group,
    as a peer's fault; nothing of it is applied (the step-4 epoch is the
    last one), and the job resumes from it to the undisturbed losses."""
    train, val = data
    coord = start_fleet(procs, 2)
    ref = submit(coord, diloco_spec(train, val, 12, 2, str(tmp_path / "r"), compression="int8"),
                 tmp_path, "r.json")
    assert wait_job(coord, ref, timeout=120)["step"] == 12
    spec = diloco_spec(train, val, 12, 2, str(tmp_path / "c"), compression="int8",
                       fault_injection={"corrupt_compressed_at_step": 8})
    jid = submit(coord, spec, tmp_path, "c.json")
    j = wait_job(coord, jid, timeout=120)
    assert j["step"] == 12 and j["generation"] >= 2, j
    assert losses(coord, jid) == losses(coord, ref)
    logs = "".join(w.output() for w in coord.workers.values())
    assert ("DiLoCo: the compressed pseudo-gradients: int8 block 0 from group 1: value -128 at 0 "
            "is out of range [-127, 127]") in logs, logs[-3000:]
    fails = [e for e in events(coord, job=jid) if e["kind"] == "rank_failed"]
    assert fails and any("int8 block 0 from group 1" in e["detail"] for e in fails), fails


def test_lost_group_is_dropped_from_its_round(procs, tmp_path, data):
    """A worker SIGKILLed mid-round: the other groups finish the round and
    find the loss when they meet; each keeps its round, the job re-forms
    on the two from the round's first epoch, and they take their rounds
    back and meet at once. The outer step of that round averages the two
    survivors' pseudo-gradients (the paper's rule on the epoch's files),
    and the round is not computed again. The victim is the slow rank 0,
    so that both survivors are waiting where the groups meet when it dies
    (a survivor still inside its round when the job re-forms drops it)."""
    train, val = data
    coord = start_fleet(procs, 3)
    spec = diloco_spec(train, val, 16, 3, str(tmp_path / "ck"), gbs=36,
                       fault_injection={"slow_rank": 0, "slow_micro_ms": 30})
    spec["elastic"] = {"min_workers": 2, "max_workers": 3}
    jid = submit(coord, spec, tmp_path, "lost.json")
    wait_until(lambda: 4 in committed(coord, jid), 120, "the epoch of step 4")
    victim = next(n for n, w in coord.workers.items() if "generation 1: rank 0 of 3" in w.output())
    coord.workers[victim].kill()
    j = wait_job(coord, jid, timeout=180)
    assert j["step"] == 16 and j["generation"] >= 2 and len(job_members(coord, jid)) == 2, j
    logs = "".join(w.output() for n, w in coord.workers.items() if n != victim)
    kept = re.findall(r"keeps its round (\d+)\.\.(\d+)", logs)
    took = re.findall(r"takes back its round (\d+)\.\.(\d+) \(computed as group \d of 3\)", logs)
    assert len(kept) == 2 and len(set(kept)) == 1 and took == kept, (kept, took)
    a, b = int(kept[0][0]) - 1, int(kept[0][1])
    eps = committed(coord, jid)
    assert a in eps and b in eps, eps
    _, prev = read_epoch(eps[a])
    man, cur = read_epoch(eps[b])
    U = man["diloco"]["units"]
    assert man["diloco"]["groups"] == 2
    want_p, want_m = outer_rule(prev, cur, 2, U)
    for u in range(U):
        assert close(cur[u][0], want_p[u]) and close(cur[u][1], want_m[u]), f"unit {u}"
    got = losses(coord, jid)
    assert sorted(got) == list(range(1, 17)) and got[16] < got[1]


def fragments_of(sizes, F):
    """engine/diloco.c's assignment: the largest unit first (the lowest
    index among equals), each to the fragment holding the fewest elements
    so far (the lowest index among equals)."""
    load, frag = [0] * F, {}
    for u in sorted(range(len(sizes)), key=lambda u: (-sizes[u], u)):
        f = min(range(F), key=lambda f: (load[f], f))
        frag[u] = f
        load[f] += sizes[u]
    return frag


def test_fragments_sync_on_their_own_steps(procs, tmp_path, data):
    """sync.fragments 2 (Streaming DiLoCo): the units in two fragments of
    about equal size; fragment 0 syncs after steps 2, 6, 10, ... and
    fragment 1 where the rounds end (4, 8, ...). Every epoch where a round
    ends holds fragment 1 moved by the paper's rule from the groups' inner
    parameters, and fragment 0 moved since the epoch before (its own sync
    in the middle of the round). With int4 error feedback and overlap, a
    ring broken under fragment 0's all-reduce at step 10 resumes from
    step 8 to the same losses as an undisturbed run."""
    train, val = data
    coord = start_fleet(procs, 2)
    spec = diloco_spec(train, val, 16, 2, str(tmp_path / "ck"), gbs=24,
                       fault_injection={"slow_rank": 0, "slow_micro_ms": 10})
    spec["sync"]["fragments"] = 2
    jid = submit(coord, spec, tmp_path, "d.json")
    assert wait_job(coord, jid, timeout=120)["step"] == 16
    got = losses(coord, jid)
    assert sorted(got) == list(range(1, 17)) and got[16] < got[1]
    eps = committed(coord, jid)
    pairs = [(a, a + H) for a in sorted(eps) if a + H in eps and a + H < 16]
    assert pairs, eps
    logs = "".join(w.output() for w in coord.workers.values())
    for a, b in pairs:
        _, prev = read_epoch(eps[a])
        man, cur = read_epoch(eps[b])
        U = man["diloco"]["units"]
        frag = fragments_of([len(cur[u][0]) for u in range(U)], 2)
        assert sorted(set(frag.values())) == [0, 1]
        for f in (0, 1):
            units = ",".join(str(u) for u in range(U) if frag[u] == f)
            assert f"fragment {f} of 2: units [{units}]" in logs, (f, units)
        want_p, want_m = outer_rule(prev, cur, 2, U)
        for u in range(U):
            if frag[u] == 1:
                assert close(cur[u][0], want_p[u]), f"epoch {b} unit {u}: outer parameters"
                assert close(cur[u][1], want_m[u]), f"epoch {b} unit {u}: outer momentum"
            else:
                assert not np.array_equal(cur[u][0], prev[u][0]), f"unit {u} never synced"
                assert not close(cur[u][0], want_p[u]), f"unit {u} synced at the round's end"
    # Streamed with int4 (the residual of each fragment's elements) and
    # overlap: undisturbed, then broken at step 10 (fragment 0's sync).
    runs = {}
    for name, fault in (("ref", {}), ("broken", {"break_ring_before_update_at_step": 10})):
        spec = diloco_spec(train, val, 16, 2, str(tmp_path / name), every=8, compression="int4",
                           fault_injection=fault)
        spec["sync"].update(fragments=2, overlap_steps=1)
        rid = submit(coord, spec, tmp_path, f"{name}.json")
        j = wait_job(coord, rid, timeout=120)
        assert j["step"] == 16, j
        runs[name] = (j, losses(coord, rid))
    assert runs["broken"][0]["generation"] >= 2, runs["broken"][0]
    assert runs["broken"][1] == runs["ref"][1]
    assert runs["ref"][1] != got
    logs = "".join(w.output() for w in coord.workers.values())
    assert "training failed at step 11: DiLoCo: the pseudo-gradient's all-reduce" in logs


def test_groups_of_two_with_zero_inside(procs, tmp_path, data):
    """sync.group_size 2: four workers in two groups of two, each group one
    model under ZeRO (stages 0, 2 and 3) over its own connections, the
    outer all-reduce between the ranks at the same place of each group
    (each carries its half of the model). A group computes exactly the
    micro-batches that one worker of two groups would, and ZeRO's sums do
    not depend on the world size, so the losses equal two one-worker
    groups' bit for bit, and so does a run whose ring breaks before the
    outer step of step 8 (resumed from step 4's epoch, every rank loading
    its owned range of its group's state)."""
    train, val = data
    coord = start_fleet(procs, 4)
    ref = submit(coord, diloco_spec(train, val, 16, 2, str(tmp_path / "ref")), tmp_path, "r.json")
    assert wait_job(coord, ref, timeout=120)["step"] == 16
    want = losses(coord, ref)
    for stage, fault in ((0, {}), (2, {}), (3, {}),
                         (2, {"break_ring_before_update_at_step": 8})):
        name = f"g{stage}{'f' if fault else ''}"
        spec = diloco_spec(train, val, 16, 4, str(tmp_path / name), fault_injection=fault)
        spec["zero_optimization"] = {"stage": stage}
        spec["sync"]["group_size"] = 2
        jid = submit(coord, spec, tmp_path, f"{name}.json")
        j = wait_job(coord, jid, timeout=120)
        assert j["step"] == 16 and j["world"] == 4, (name, j)
        assert j["generation"] == (2 if fault else 1), (name, j)
        assert losses(coord, jid) == want, name
    man, units = read_epoch(committed(coord, jid)[16])
    U = man["diloco"]["units"]
    assert man["world"] == 4 and man["diloco"]["groups"] == 2
    assert sorted(units) == list(range(U * 3)), "real units, then each group's"
    logs = "".join(w.output() for w in coord.workers.values())
    assert "diloco: 2 groups of 2 ranks (ZeRO stage 2 inside each)" in logs
    # A worker killed in a round: a world of three has no whole groups, so
    # the job goes on as one group of two from the last epoch (its owned
    # ranges resharded from two groups' files) and completes.
    spec = diloco_spec(train, val, 16, 4, str(tmp_path / "k"), max_workers=4,
                       fault_injection={"slow_rank": 0, "slow_micro_ms": 30})
    spec["elastic"]["min_workers"] = 2
    spec["zero_optimization"] = {"stage": 2}
    spec["sync"]["group_size"] = 2
    jid = submit(coord, spec, tmp_path, "k.json")
    # Some epoch before the kill (the workers skip a periodic epoch by
    # design while the last one's copies are in flight, so not step 8's
    # in particular): step 4's comes first and is never skipped.
    wait_until(lambda: committed(coord, jid), 120, "a committed epoch")
    victim = sorted(job_members(coord, jid))[-1]
    coord.workers[victim].kill()
    j = wait_job(coord, jid, timeout=180)
    assert j["step"] == 16 and j["world"] == 2 and j["generation"] >= 2, j
    got = losses(coord, jid)
    assert sorted(got) == list(range(1, 17)) and all(np.isfinite(list(got.values())))


def refused_total(coord, jid):
    _, _, body = http_get(coord.http_port, "/metrics")
    m = re.search(r'^ztrain_job_outer_steps_refused_total\{job_id="%d"\} (\S+)$' % jid, body,
                  re.M)
    assert m, "no ztrain_job_outer_steps_refused_total series for the job"
    return float(m.group(1))


def test_refused_outer_steps_are_counted_and_only_those(procs, tmp_path, data):
    """An applied outer step is not logged as refused (the trainer once read
    `applied` before the call that set it), and a real refusal (a NaN in the
    last rank's pseudo-gradient at step 8) is logged by every rank, counted
    in /metrics and written to the logbook; the job goes on and completes."""
    train, val = data
    coord = start_fleet(procs, 2)
    jid = submit(coord, diloco_spec(train, val, 16, 2, str(tmp_path / "ok")), tmp_path, "ok.json")
    assert wait_job(coord, jid, timeout=120)["step"] == 16
    logs = "".join(w.output() for w in coord.workers.values())
    assert "outer step refused" not in logs, logs[-3000:]
    assert refused_total(coord, jid) == 0
    marks = {n: len(w.output()) for n, w in coord.workers.items()}
    spec = diloco_spec(train, val, 16, 2, str(tmp_path / "nan"),
                       fault_injection={"nan_pseudo_gradient_at_step": 8})
    bad = submit(coord, spec, tmp_path, "nan.json")
    assert wait_job(coord, bad, timeout=120)["step"] == 16
    new = [w.output()[marks[n]:] for n, w in coord.workers.items()]
    for text in new:
        lines = [ln for ln in text.splitlines() if "outer step refused" in ln]
        assert len(lines) == 1 and "step 8:" in lines[0], lines
    assert refused_total(coord, bad) == 1
    ev = [e for e in events(coord, job=bad) if e["kind"] == "outer_step_refused"]
    assert len(ev) == 1 and "by step 8" in ev[0]["detail"], ev
    got = losses(coord, bad)
    assert sorted(got) == list(range(1, 17)) and all(np.isfinite(list(got.values())))
