"""Work shared by speed (load_balance, engine/trainer.c): real zworkers
under zcoord, one of them made slow by the fault_injection knob
(slow_micro_ms on one rank). Each step's micro-batches move to the fast
rank, and the losses stay those of one undisturbed worker: the shares
change who computes a micro-batch, never which samples a step holds, and
the gradient sums are fp64."""
import re

import pytest

from ztest import (byte_dataset, events, job_members, losses, start_fleet, submit, tiny_spec, wait_job,
                   wait_until,
                   zctl)

STEPS = 30
PLAN = re.compile(r"load balance (after a step|at the generation's start): "
                  r"micro-batches per rank (\d+),(\d+) \(was (\d+),(\d+)\)")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=200_000)


def plans(coord, when="after a step"):
    """The plans rank 0 logged `when`: [(new shares, old shares)]."""
    out = []
    for w in coord.workers.values():
        for m in PLAN.finditer(w.output()):
            g = [int(x) for x in m.groups()[1:]]
            if m.group(1) == when:
                out.append((g[:2], g[2:]))
    return out


LLAMA = {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32,
         "intermediate_size": 64, "seq_len": 32, "vocab_size": 257}


# Stage 1 reduces once a step; stages 2-3 in every micro-step, so the slow
# rank runs ZeRO's hooks alone for the micro-steps it has no batch for
# (stage 3 also gathers every unit there); the llama case has its own head
# (untied), a different hook order in backward.
@pytest.mark.parametrize("stage,arch", [(1, "gpt2"), (3, "gpt2"), (2, "llama")])
def test_shares_follow_speed_and_losses_do_not_move(procs, tmp_path, data, stage, arch):
    train, val = data
    coord = start_fleet(procs, 2)
    ref_spec = tiny_spec(train, val, STEPS, 0, 1)
    if arch == "llama":
        ref_spec["model"] = dict(LLAMA)
    rid = submit(coord, ref_spec, tmp_path, "ref.json")
    assert wait_job(coord, rid, timeout=120)["step"] == STEPS
    want = losses(coord, rid)

    spec = tiny_spec(train, val, STEPS, stage, 2)
    spec["model"] = ref_spec["model"]
    spec["load_balance"] = {"mode": "speed", "every_steps": 5}
    spec["fault_injection"] = {"slow_rank": 1, "slow_micro_ms": 40}
    jid = submit(coord, spec, tmp_path, f"speed{stage}.json")
    assert wait_job(coord, jid, timeout=180)["step"] == STEPS
    got = losses(coord, jid)
    # 12 micro-batches a step, 6 each at first: the slow rank (40 ms more
    # on each) keeps at most 3 after the first plan, at step 5, even if a
    # busy machine made the fast rank's micro-batch take 20 ms (1 when idle).
    p = plans(coord)
    assert p, "no load balance plan was logged"
    new, old = p[0]
    assert old == [6, 6] and sum(new) == 12 and new[1] <= 3 < new[0], p
    # The coordinator's logbook has the plan by worker name.
    ev = [e["detail"] for e in events(coord) if e["kind"] == "load_balance"]
    assert ev and ev[0].startswith("from step 6, micro-batches per worker"), ev
    per = dict(x.split() for x in ev[0].split(": ")[1].split(", "))
    assert set(per) == job_members(coord, jid), ev
    assert sorted(int(n) for n in per.values()) == sorted(new), ev
    # Bit for bit: the same samples per step, the same fp64 sums.
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert got[s] == want[s], f"step {s}: {got[s]!r} with shares by speed, {want[s]!r} alone"


def test_equal_mode_and_bad_mode(procs, tmp_path, data):
    """mode "equal" is today's plan (no plan logged even with a slow rank);
    an unknown mode is refused by name."""
    train, val = data
    coord = start_fleet(procs, 2)
    spec = tiny_spec(train, val, 10, 2, 2)
    spec["load_balance"] = {"mode": "equal", "every_steps": 2}
    spec["fault_injection"] = {"slow_rank": 1, "slow_micro_ms": 5}
    assert wait_job(coord, submit(coord, spec, tmp_path, "eq.json"), timeout=120)["step"] == 10
    assert plans(coord) == []
    spec["load_balance"] = {"mode": "fastest"}
    with pytest.raises(Exception) as e:
        submit(coord, spec, tmp_path, "bad.json")
    assert "load_balance.mode" in str(e.value) and "fastest" in str(e.value)


def test_next_generation_starts_by_speed(procs, tmp_path, data):
    """Each worker keeps what it measured across generations of a job: when
    the ring breaks (the fault knob, in every generation at step 12) and the
    job re-forms on the same two workers, the new generation's first plan is
    by speed, before its first step, rather than equal shares for another
    five steps."""
    train, val = data
    coord = start_fleet(procs, 2)
    spec = tiny_spec(train, val, 40, 1, 2)
    spec["load_balance"] = {"mode": "speed", "every_steps": 5}
    spec["fault_injection"] = {"slow_rank": 1, "slow_micro_ms": 40, "break_ring_at_step": 12}
    jid = submit(coord, spec, tmp_path, "regen.json")
    start = wait_until(lambda: plans(coord, "at the generation's start"), 90,
                       "a plan at the start of the second generation")
    assert plans(coord)[0][1] == [6, 6], plans(coord)  # the first generation planned after step 5
    new, old = start[0]
    # Ranks may be dealt anew: the slow worker's share is the small one.
    assert old == [6, 6] and sum(new) == 12 and min(new) <= 3, start
    zctl(coord.grpc, "cancel", str(jid))


def test_any_world_size_with_shares_by_speed(procs, tmp_path, data):
    """Shares by speed need no world size that divides a step's
    micro-batches: 12 micro-batches on 5 workers (3,3,2,2,2 until a plan
    by speed), the losses of one worker bit for bit. With equal shares the
    same job is refused at submit, and the message names the way out."""
    train, val = data
    coord = start_fleet(procs, 5)
    rid = submit(coord, tiny_spec(train, val, 12, 0, 1), tmp_path, "ref5.json")
    assert wait_job(coord, rid, timeout=120)["step"] == 12
    want = losses(coord, rid)
    spec = tiny_spec(train, val, 12, 2, 5)
    spec["load_balance"] = {"mode": "speed", "every_steps": 4}
    jid = submit(coord, spec, tmp_path, "five.json")
    assert wait_job(coord, jid, timeout=180)["step"] == 12
    assert len(job_members(coord, jid)) == 5
    assert losses(coord, jid) == want
    spec["load_balance"] = {"mode": "equal"}
    with pytest.raises(Exception) as e:
        submit(coord, spec, tmp_path, "five-equal.json")
    assert "no world size in 5..5 divides" in str(e.value) and "load_balance" in str(e.value)
