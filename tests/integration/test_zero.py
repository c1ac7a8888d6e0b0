"""ZeRO stages 0-3 across real zworker processes under zcoord.

For each stage and N = 1..4 ranks the per-step losses of 50 steps of the
tiny model must equal the single-process run (N = 1, stage 0) within 1e-5
relative: same global batch, same seed, the same samples in every step
(gradient sums are exact in fp64, so in practice they are bit-identical).
The bytes of model states each rank holds (the allocations the worker
reports) must match the formulas of docs/zero.md.
"""
import glob
import json
import os

import pytest

from ztest import (breakdown_rows, byte_dataset, losses, start_fleet, submit, tiny_spec,
                   wait_job, wait_until)

STEPS = 50


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=300_000)


def run_job(procs, coord, tmp_path, spec, name, val=False):
    jid = submit(coord, spec, tmp_path, name + ".json")
    j = wait_job(coord, jid, timeout=180)
    assert j["step"] == STEPS
    return losses(coord, jid, val)


def test_stages_match_single_process(procs, tmp_path, data):
    train, val = data
    coord = start_fleet(procs, 4)
    ref = run_job(procs, coord, tmp_path, tiny_spec(train, val, STEPS, 0, 1), "ref")
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert ref[STEPS] < ref[1] - 1.0, "the tiny model should learn"
    worst = 0.0
    for stage in range(4):
        for n in range(1, 5):
            if stage == 0 and n == 1:
                continue
            got = run_job(procs, coord, tmp_path, tiny_spec(train, val, STEPS, stage, n),
                          f"s{stage}n{n}")
            for s in range(1, STEPS + 1):
                rel = abs(got[s] - ref[s]) / abs(ref[s])
                worst = max(worst, rel)
                assert rel <= 1e-5, f"stage {stage} N={n} step {s}: {got[s]} vs {ref[s]}"
    print(f"largest relative loss difference over all stages and N: {worst:.2e}")


def expected_bytes(stage, n, psi):
    """fp32 model-state bytes per rank (docs/zero.md), without padding."""
    return {0: 24 * psi, 1: 16 * psi + 8 * psi / n, 2: 4 * psi + 16 * psi / n,
            3: 20 * psi / n}[stage]


@pytest.mark.parametrize("stage,compression", [(0, "none"), (1, "none"), (2, "none"),
                                               (3, "none"), (1, "int8"), (3, "bf16")])
def test_model_state_memory(procs, tmp_path, data, stage, compression):
    """Each rank's model states against docs/zero.md, and the scheduler's
    estimate against what the worker allocates, to the byte (with
    sync.compression, its send, receive and decode buffers too)."""
    train, val = data
    n = 4
    coord = start_fleet(procs, n)
    spec = tiny_spec(train, val, 3, stage, n)
    spec["sync"] = {"compression": compression}
    spec["model"] = {"n_layer": 4, "n_head": 4, "n_embd": 128, "seq_len": 32, "vocab_size": 257}
    jid = submit(coord, spec, tmp_path)
    wait_job(coord, jid)
    for i in range(n):
        with open(os.path.join(procs.tmp, "work", f"w{i}", "zero_memory.json")) as f:
            m = json.load(f)
        assert m["stage"] == stage and m["world"] == n
        psi, pad = m["psi"], m["padding"]
        held = m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]
        want = expected_bytes(stage, n, psi)
        # Padding: at most 8N-1 elements per unit in each buffer (4+4+8+4+4 bytes).
        slack = 0.01 * want + 24 * pad
        assert abs(held - want) <= slack, (stage, i, held, want, m)
        # What is in flight (stages 2-3: a few units) stays well below one
        # full copy of the model states.
        assert m["inflight_bytes"] < 8 * psi
        # The scheduler admits jobs by an estimate (engine/memplan.c) that
        # must be exactly what the worker allocates: states, and the
        # activations plus the int inputs, targets and host losses.
        states = held + m["inflight_bytes"] + m["scratch_bytes"]
        assert m["estimated_states_bytes"] == states, (stage, i, m)
        B, T = spec["train_micro_batch_size_per_gpu"], spec["model"]["seq_len"]
        assert m["estimated_activation_bytes"] == m["activation_bytes"] + 12 * B * T, m


def test_one_micro_step_per_rank_and_mixed_paths(procs, tmp_path, data):
    """With one micro-step per rank (train_batch_size = micro batch x N) the gradient sum of
    stages 0-1 is the fp32 gradient itself, so the ring reduce-scatters it from there, its
    first step as fp32, without an fp64 copy. A generation whose w0 takes the device path
    (ZT_TEST_STAGE_COLLECTIVES: collectives staged through host memory, no overlap thread)
    mixes both paths, and since overlap changes the order of
    the collectives its ranks agree to run without it (the CPU ranks log why). The loss
    series equals the single-process run's (three micro-steps) to the bit: CPU-only with
    overlap on and off, and mixed at every stage."""
    train, val = data

    def series(coord, stage, n, ov, name):
        spec = tiny_spec(train, val, STEPS, stage, n, gbs=6)
        spec["zero_optimization"]["overlap_comm"] = ov
        return run_job(procs, coord, tmp_path, spec, name)

    def check(got, ref, what):
        assert got == ref, (what, [(s, got[s], ref[s]) for s in ref if got[s] != ref[s]][:3])

    cpu = start_fleet(procs, 3, prefix="c")
    ref = series(cpu, 0, 1, True, "one-ref")
    for stage in (0, 1):
        for ov in (True, False):
            check(series(cpu, stage, 3, ov, f"one-s{stage}{ov}"), ref, (stage, ov))
    mixed = start_fleet(procs, 3, env_by_name={"w0": {"ZT_TEST_STAGE_COLLECTIVES": "1"}},
                        db=os.path.join(procs.tmp, "mixed.db"), name="zcoord-mixed")
    for stage in (0, 1, 2, 3):
        check(series(mixed, stage, 3, True, f"mixed-s{stage}"), ref, ("mixed", stage))
    for name in ("w1", "w2"):
        assert "overlap_comm: off for this generation (1 of 3 ranks run on a device)" in \
            mixed.workers[name].output()
    assert "overlap_comm: off" not in "".join(w.output() for w in cpu.workers.values())


def test_two_micro_steps_per_rank_reduced_each(procs, tmp_path, data):
    """With two micro-steps per rank, stages 0-1 reduce-scatter each micro-step's fp32 gradient
    by itself where the communicator sends fp32 straight to each owner (two ranks, or a mesh
    from three): the bytes of one fp64 reduction, the first half of them hidden behind the
    rest of the step. The loss series equals the single-process run's to the bit, with
    overlap on and off; rank 0 says which plan it runs, and with four micro-steps per rank
    it keeps the one fp64 reduction."""
    train, val = data
    coord = start_fleet(procs, 3, prefix="k")
    plan = "fp32 gradients is reduce-scattered straight to its owners"

    def series(stage, n, gbs, ov, name):
        spec = tiny_spec(train, val, STEPS, stage, n, gbs=gbs)
        spec["zero_optimization"]["overlap_comm"] = ov
        return run_job(procs, coord, tmp_path, spec, name)

    def said():
        return sum(w.output().count(plan) for w in coord.workers.values())

    for n in (2, 3):
        gbs = 2 * 2 * n  # micro batch 2, two micro-steps per rank
        ref = series(0, 1, gbs, True, f"each-ref{n}")
        for stage in (0, 1):
            for ov in (True, False):
                before = said()
                got = series(stage, n, gbs, ov, f"each-s{stage}n{n}{ov}")
                assert got == ref, (stage, n, ov,
                                    [(s, got[s], ref[s]) for s in ref if got[s] != ref[s]][:3])
                assert said() > before, (stage, n, ov)
    before = said()
    series(1, 3, 24, True, "each-k4")
    assert said() == before


def test_staged_collectives_match(procs, tmp_path, data):
    """The device path's collectives (buffers staged through host memory,
    in-place reduce-scatter and all-gather included) give the same losses.
    ZT_TEST_STAGE_COLLECTIVES=1 makes CPU workers take that path."""
    train, val = data
    coord = start_fleet(procs, 3, worker_env={"ZT_TEST_STAGE_COLLECTIVES": "1"})
    ref = run_job(procs, coord, tmp_path, tiny_spec(train, val, STEPS, 0, 1), "ref1")
    for stage, n in ((0, 2), (1, 3), (2, 2), (3, 3)):
        got = run_job(procs, coord, tmp_path, tiny_spec(train, val, STEPS, stage, n),
                      f"staged-s{stage}n{n}")
        for s in range(1, STEPS + 1):
            assert abs(got[s] - ref[s]) <= 1e-5 * abs(ref[s]), \
                f"staged stage {stage} N={n} step {s}: {got[s]} vs {ref[s]}"


def test_activation_checkpointing_bit_identical(procs, tmp_path, data):
    """activation_checkpointing: true recomputes each layer in backward: the loss series is the
    same to the bit at every stage tried, and the worker allocates (and the scheduler's estimate
    counts) one layer of recomputable activations instead of n_layer."""
    train, val = data
    coord = start_fleet(procs, 2)

    def newest_memory():
        import glob
        path = max(glob.glob(os.path.join(procs.tmp, "work", "w*", "zero_memory.json")),
                   key=os.path.getmtime)
        return json.load(open(path))

    for stage, n in ((0, 1), (3, 2)):
        spec = tiny_spec(train, val, STEPS, stage, n)
        spec["model"]["n_layer"] = 4
        ref = run_job(procs, coord, tmp_path, spec, f"plain-s{stage}")
        mem_plain = newest_memory()
        spec["activation_checkpointing"] = True
        got = run_job(procs, coord, tmp_path, spec, f"recompute-s{stage}")
        assert got == ref, f"stage {stage}: losses differ with activation checkpointing"
        mem = newest_memory()
        B, T, C, NH, L = 2, 32, 32, 2, 4
        per_layer = B * T * (15 * C + 4 + NH) * 4
        assert mem_plain["activation_bytes"] - mem["activation_bytes"] == (L - 1) * per_layer
        assert mem["estimated_activation_bytes"] == mem["activation_bytes"] + 12 * B * T


def test_overlap_comm_bit_identical(procs, tmp_path, data):
    """zero_optimization.overlap_comm (the default) reduces each unit's gradient on a
    communication thread while backward goes on: the loss series equals the synchronous one to
    the bit (stages 0 and 1 reduce after the last micro-step, stages 2 and 3 in every
    micro-step, with 2 or 4 micro-steps per rank; stages 1 and 2 gather the updated
    parameters, and stage 0 the scaled gradient (each unit's update waits for it), on the
    thread while the next forward computes, waiting unit by unit; stage 3
    also prefetches the next unit's parameters on the thread)."""
    train, val = data
    coord = start_fleet(procs, 3)
    for stage, n in ((0, 2), (1, 3), (2, 3), (2, 2), (3, 3), (3, 2)):
        spec = tiny_spec(train, val, STEPS, stage, n)
        spec["zero_optimization"]["overlap_comm"] = False
        ref = run_job(procs, coord, tmp_path, spec, f"sync-s{stage}n{n}")
        spec["zero_optimization"]["overlap_comm"] = True
        got = run_job(procs, coord, tmp_path, spec, f"overlap-s{stage}n{n}")
        assert got == ref, f"stage {stage} N={n}: overlap changed the losses"
    # Stages 0-2 with an evaluation and a checkpoint between steps: both
    # run while the deferred gathers (stage 0: of the gradient, with the
    # update of each unit still due) may be in flight (the evaluation's
    # forward waits unit by unit, the snapshot for all), so validation
    # losses and the final checkpoint's loss series match too.
    for stage, n in ((0, 3), (1, 3), (2, 2)):
        out = {}
        for ov in (False, True):
            spec = tiny_spec(train, val, STEPS, stage, n, eval={"every_steps": 3, "batches": 2},
                             checkpoint={"dir": str(tmp_path / f"ck-{stage}-{ov}"),
                                         "every_steps": 4})
            spec["zero_optimization"]["overlap_comm"] = ov
            out[ov] = run_job(procs, coord, tmp_path, spec, f"ev-s{stage}-{ov}", val=True)
        vals = [v for _, v in out[True].values() if v is not None]
        assert len(vals) >= STEPS // 3 - 1, out[True]
        assert out[True] == out[False], f"stage {stage}: overlap changed losses or val losses"


def test_wall_clock_breakdown(procs, tmp_path, data):
    """wall_clock_breakdown: true makes every worker log, per step, how long it waited for
    communication and what the communication thread spent. With overlap the thread is
    busy and its CPU time fits inside its busy time; without it the thread does nothing
    and the training thread's waits are the collectives themselves; without the key
    nothing is logged."""
    train, val = data
    coord = start_fleet(procs, 2)
    ws = list(coord.workers.values())
    steps = 6
    for stage, overlap, on in ((1, True, True), (2, False, True), (0, True, False)):
        spec = tiny_spec(train, val, steps, stage, 2)
        spec["zero_optimization"]["overlap_comm"] = overlap
        if on:
            spec["wall_clock_breakdown"] = True
        start = [len(w.output()) for w in ws]
        wait_job(coord, submit(coord, spec, tmp_path, f"wcb-{stage}.json"), timeout=180)
        for w, at in zip(ws, start):
            if not on:
                assert breakdown_rows(w.output()[at:]) == [], w.output()[at:]
                continue
            # The job completes when the last step is reported; its line may
            # be logged a moment later.
            rows = wait_until(lambda: (lambda r: r if len(r) >= steps else None)(
                breakdown_rows(w.output()[at:])), 10, "every step's breakdown line")
            assert [int(r[0]) for r in rows] == list(range(1, steps + 1)), rows
            for _, ms, red, gat, busy, cpu in rows:
                assert red + gat <= ms + 0.5, rows
                assert cpu <= busy + 1.0, rows
                if overlap:
                    assert busy > 0, rows
                else:
                    assert busy == 0 and cpu == 0 and red > 0, rows


def test_embedding_unit_reduced_in_pieces(procs, tmp_path, data):
    """Stages 2-3 size their in-flight buffers by the largest unit other than unit 0 (the
    embeddings) and reduce unit 0's gradient in pieces of that size. With a vocabulary of
    1024 unit 0 is 2.7 times a layer: the loss series still equals the single-process run
    to the bit (with overlap and without, N = 2 and 3), and the in-flight bytes grow only
    by unit 0's own gradient buffer against a vocabulary of 257."""
    train, val = data
    coord = start_fleet(procs, 3)
    steps = 12

    def spec(stage, n, vocab=1024, overlap=True):
        s = tiny_spec(train, val, steps, stage, n)
        s["model"]["vocab_size"] = vocab
        s["zero_optimization"]["overlap_comm"] = overlap
        return s

    def run(s, name):
        jid = submit(coord, s, tmp_path, name + ".json")
        assert wait_job(coord, jid, timeout=180)["step"] == steps
        return losses(coord, jid)

    def reports():
        return [os.path.join(procs.tmp, "work", w, "zero_memory.json") for w in coord.workers]

    def inflight(s, name):
        """The in-flight bytes the job's ranks report (each worker rewrites its report)."""
        for path in reports():
            if os.path.exists(path):
                os.unlink(path)
        run(s, name)
        got = set()
        for path in filter(os.path.exists, reports()):
            with open(path) as f:
                got.add(json.load(f)["inflight_bytes"])
        assert len(got) == 1, got
        return got.pop()

    ref = run(spec(0, 1), "pieces-ref")
    for stage, n, ov in ((2, 2, True), (2, 2, False), (3, 3, True), (3, 2, False)):
        got = run(spec(stage, n, overlap=ov), f"pieces-s{stage}n{n}{ov}")
        assert got == ref, f"stage {stage} N={n} overlap {ov}: losses differ"
    big = inflight(spec(2, 2), "pieces-mem-1024")
    small = inflight(spec(2, 2, vocab=257), "pieces-mem-257")
    C = 32
    # Only tg0 (4 bytes per element of unit 0, padded to 8 N elements) grows.
    assert 0 < big - small <= 4 * (1024 - 257) * C + 4 * 8 * 2, (big, small)


def unit0_pieces(model, n):
    """How many pieces stages 2-3 reduce unit 0's gradient (the embeddings and the tied head)
    in at N = n (engine/zero_impl.h, piece_len): unit 0's shard over the shard of the largest other
    unit, shards being ceil(size / n) rounded up to 8 elements, the vocabulary padded to 64."""
    C, T = model["n_embd"], model["seq_len"]
    V = -(-model["vocab_size"] // 64) * 64

    def shard(size):
        return -(-(-(-size // n)) // 8) * 8

    piece = max(shard(12 * C * C + 13 * C), shard(2 * C))
    return -(-shard((V + T) * C) // piece)


def test_overlap_queue_holds_many_unit0_pieces(procs, tmp_path, data):
    """Stages 2-3 with overlap queue every piece of unit 0's gradient at once, when its backward
    ends. With a vocabulary of 16384 (the byte data uses 257 of it) and two small layers, unit 0
    is 42 pieces at N = 2, more than three times the 2 U + 5 = 13 entries the communication
    queue used to hold, where pushes wrote over entries the thread had not read yet. The queue
    now waits for room and is sized from the real piece count: the loss series of stages 2 and 3
    with overlap equals the synchronous one and the single-process run's to the bit."""
    train, val = data
    coord = start_fleet(procs, 2)
    steps = 8
    model = {**tiny_spec(train, val)["model"], "vocab_size": 16384}
    units = model["n_layer"] + 2
    assert unit0_pieces(model, 2) > 3 * (2 * units + 5), unit0_pieces(model, 2)

    def series(stage, n, overlap, name):
        spec = tiny_spec(train, val, steps, stage, n)
        spec["model"] = dict(model)
        spec["zero_optimization"]["overlap_comm"] = overlap
        jid = submit(coord, spec, tmp_path, name + ".json")
        assert wait_job(coord, jid, timeout=120)["step"] == steps
        return losses(coord, jid)

    ref = series(0, 1, False, "queue-ref")
    for stage in (2, 3):
        for ov in (False, True):
            got = series(stage, 2, ov, f"queue-s{stage}-{ov}")
            assert got == ref, (stage, ov, [(s, got[s], ref[s]) for s in ref
                                            if got.get(s) != ref[s]][:3])


def test_stage3_evaluation_batches_not_divisible_by_ranks(procs, tmp_path, data):
    """At stage 3 each forward all-gathers every unit's parameters, so all ranks must run as
    many validation forwards: with 4 batches over 3 ranks each runs 2 (a forward past the last
    batch repeats batch 0 and is not counted), where rank 0 used to run 2 and the others 1,
    so the ranks issued different collectives and the generation failed at every evaluation.
    The job completes, with overlap on and off, and its losses and validation losses equal
    the single-process run's to the bit (the validation losses are summed in fp64, so how the
    batches are spread over the ranks changes no bit)."""
    train, val = data
    coord = start_fleet(procs, 3)
    steps = 12

    def series(stage, n, overlap, name):
        spec = tiny_spec(train, val, steps, stage, n, eval={"every_steps": 3, "batches": 4})
        spec["zero_optimization"]["overlap_comm"] = overlap
        jid = submit(coord, spec, tmp_path, name + ".json")
        assert wait_job(coord, jid, timeout=120)["step"] == steps
        return losses(coord, jid, val=True)

    ref = series(0, 1, True, "eval-ref")
    assert [s for s, (_, v) in sorted(ref.items()) if v is not None] == [3, 6, 9, 12], ref
    for ov in (True, False):
        got = series(3, 3, ov, f"eval-s3-{ov}")
        assert got == ref, (ov, [(s, got[s], ref[s]) for s in ref if got.get(s) != ref[s]][:3])


def test_stage0_checkpoint_refused_without_the_updates(procs, tmp_path, data):
    """Stage 0 with overlap applies each unit's update when the all-gather of its scaled
    gradient arrives: in the hook before the next forward, or when a checkpoint snapshot
    settles the queue first. fault_injection.break_ring_before_update_at_step makes the last
    rank abort its ring after the reduction of step 6, the first checkpoint step, so those
    gathers fail on both ranks and the updates of step 6 are never applied: an epoch labelled
    step 6 would hold step 5's parameters. No rank writes it; each fails the generation naming
    the reason, the next generation starts over, and the loss series equals a failure-free
    run's."""
    train, val = data
    coord = start_fleet(procs, 2)
    steps = 12

    def run(name, fault):
        spec = tiny_spec(train, val, steps, 0, 2,
                         checkpoint={"dir": str(tmp_path / name), "every_steps": 6})
        if fault:
            spec["fault_injection"] = {"break_ring_before_update_at_step": 6}
        jid = submit(coord, spec, tmp_path, name + ".json")
        assert wait_job(coord, jid, timeout=120)["step"] == steps
        return jid, losses(coord, jid)

    _, ref = run("ck-ref", False)
    jid, got = run("ck-fault", True)
    first = os.path.join(str(tmp_path), "ck-fault", f"job_{jid}", "step_00000006-g1")
    assert glob.glob(os.path.join(first, "rank_*")) == [], os.listdir(first)
    why = ("checkpoint of step 6 not written: the updates of 4 of 4 units were not applied, so "
           "the snapshot would mix this step's parameters with the step before's: "
           "all-gather of the scaled gradient of unit")
    for name, w in coord.workers.items():
        assert why in w.output(), name
    assert got == ref, [(s, got[s], ref[s]) for s in ref if got.get(s) != ref[s]][:3]
