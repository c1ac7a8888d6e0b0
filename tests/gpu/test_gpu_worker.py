"""zworker --device cuda:N under zcoord: GPU training tracks the CPU.

Real zcoord and zworker processes on 127.0.0.1. The tiny job of the
integration tests runs for 40 steps on CPU workers and on GPU workers (the
model and its ZeRO state on the CUDA kernel table; docs/gpu.md):

  - 1 GPU worker, fp32 products, against 1 CPU worker: the first 20 steps
    within 1e-5 relative (only the summation order differs), every step
    within 1e-2 and the last within 3e-3. Later steps drift apart by more
    than rounding: AdamW divides by sqrt(v), so a parameter whose gradient
    is tiny noise (the embedding row of a rare byte) moves by about lr in
    a direction that the rounding decides, and a batch that holds that byte
    shows it. Seen on an H100: steps 1-20 within 1e-7, 1e-6 to 5e-5 after
    step 27, one step (a rare byte) at 2.1e-3, the last at 2.4e-5. On the
    stand-in, whose products are OpenBLAS's: the last at 9.7e-4 against a
    CPU worker whose sgemm is OpenBLAS too, 1.3e-3 against one with our
    AVX-512 sgemm (kernels/cpu/gemm.c), which rounds differently.
  - The same with bf16{enabled:true} (bf16 storage: activations and the
    parameters the model reads in bf16, an fp32 master, bf16 products with
    fp32 accumulation): the first 10 steps within 5e-4, every step within
    3e-2, and the model learns (loss drops by more than 1). Seen on the
    stand-in: 7.6e-5 and 4.2e-3 (bf16 products on fp32 storage, on an H100
    before bf16 storage existed: 4e-6 and 8.5e-3).
  - bf16 storage on 2 GPU workers, ZeRO stages 0 to 3, over NCCL (devices
    of their own, on the stand-in) and over the TCP ring (sharing one GPU,
    collectives staged through host memory): every loss bit-identical to 1
    GPU worker with bf16 (the master, the fp64 sums and
    the rounding into the working copy do not depend on the world size),
    and the bytes each worker allocates (its zero_memory.json) equal the
    bf16 formulas of docs/zero.md and the scheduler's estimate, activations
    about half of fp32's.
  - 2 GPU workers, ZeRO stages 0 to 3: every loss bit-identical to the
    1-GPU-worker run. The sums are fp64, as on CPU workers
    (tests/integration/test_zero.py), so the world size does not change a
    bit. On one real GPU the two share it, and the coordinator gives them
    the TCP ring (NCCL refuses two ranks on one GPU); on the stand-in each
    has a device of its own and the generation runs over NCCL.
  - A CPU worker and a GPU worker in one generation: the TCP ring, losses
    as a CPU worker's (first 20 steps within 1e-5).
  - On the stand-in: 3 GPU workers over NCCL, one killed with SIGKILL in the
    middle of training. The survivors' NCCL communicator reports the dead
    peer (ncclCommGetAsyncError), is aborted, and they form the next
    generation, over NCCL again, and finish with the losses of a run
    without a failure.

ZT_GPU_SIM=1 (ctest's gpu_worker_sim, label gpu-sim) runs the file on the
CPU stand-ins for CUDA and NCCL (kernels/cuda/sim/; docs/gpu.md): zworker
--device cuda:N loads libzt_kernels_cuda_sim.so ($ZT_CUDA_KERNELS), and
comm/comm_nccl.c loads libzt_cudart_sim.so and libzt_nccl_sim.so
($ZT_CUDART_LIB, $ZT_NCCL_LIB). Otherwise, without a GPU the file exits 77,
which ctest reports as skipped.
"""
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))


def _have_gpu():
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    p = subprocess.run([smi, "-L"], capture_output=True, text=True)
    return p.returncode == 0 and "GPU " in p.stdout


SIM = os.environ.get("ZT_GPU_SIM") == "1"

if not SIM and not _have_gpu():
    print("test_gpu_worker: skipped: no GPU (nvidia-smi -L lists none)")
    sys.stdout.flush()
    os._exit(77)

import pytest  # noqa: E402

from ztest import (BIN, Procs, byte_dataset, job, losses, start_fleet, submit,  # noqa: E402
                   tiny_spec, wait_job, wait_until)

STEPS = 40
# The bit-identity checks (world sizes, ZeRO stages, bf16 storage) show a
# difference from the first step on, so on the stand-in, where every
# kernel runs on the CPU, they train fewer steps.
ID_STEPS = 12 if SIM else STEPS
LIB = os.path.join(BIN, "..", "lib")
SIM_ENV = {"ZT_CUDA_KERNELS": os.path.join(LIB, "libzt_kernels_cuda_sim.so"),
           "ZT_CUDART_LIB": os.path.join(LIB, "libzt_cudart_sim.so"),
           "ZT_NCCL_LIB": os.path.join(LIB, "libzt_nccl_sim.so"),
           "ZT_SIM_DEVICE_COUNT": "4", "ZT_SIM_HOST_ACCESS": "1",
           # A collective enqueued in stream order starts only when a
           # stream or the host waits for it (or 20 ms on): a kernel that
           # writes its buffers without the wait ends the worker, naming
           # the buffer (sim_nccl.cpp, "Stream order").
           "ZT_SIM_NCCL_LAZY_MS": "20"} if SIM else {}


@pytest.fixture
def procs(tmp_path):
    ps = Procs(tmp_path)
    yield ps
    ps.close()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_dataset(str(tmp_path_factory.mktemp("data")), limit=300_000)


def fleet(procs, n, device, tag, own_devices=False, env_by_name=None):
    """n workers on `device`, or on cuda:0..n-1 (own_devices)."""
    names = [f"{tag}{i}" for i in range(n)]
    by_name = {nm: ("--device", f"cuda:{i}") for i, nm in enumerate(names)} if own_devices else {}
    return start_fleet(procs, names=names, extra=("--threads", "1", "--device", device),
                       extra_by_name=by_name, timeout_ms=5000, wait_s=60, name=f"zcoord-{tag}",
                       db=os.path.join(procs.tmp, f"{tag}.db"),
                       worker_env=SIM_ENV if device != "cpu" else None, env_by_name=env_by_name)


def worker_log(procs, name):
    """Everything the process `name` (a worker, by its log name) printed."""
    with open(os.path.join(procs.tmp, f"{name}.log"), errors="replace") as f:
        return f.read()


def comm_used(procs, names):
    """Each worker's collectives by generation, from its rendezvous log lines."""
    return {nm: re.findall(r"generation (\d+): rank \d+ of \d+, .*?, (NCCL|TCP ring)",
                           worker_log(procs, nm)) for nm in names}


def run_steps(procs, coord, tmp_path, spec, name, steps):
    jid = submit(coord, spec, tmp_path, name + ".json")
    j = wait_job(coord, jid, timeout=600)
    assert j["step"] == steps
    return losses(coord, jid)


def run(procs, coord, tmp_path, spec, name):
    return run_steps(procs, coord, tmp_path, spec, name, STEPS)


def rel_diffs(a, b, label, steps=STEPS):
    rel = [abs(a[s] - b[s]) / abs(b[s]) for s in range(1, steps + 1)]
    print(f"{label}: relative loss difference by step: " + " ".join(f"{r:.1e}" for r in rel))
    return rel


def test_gpu_worker_tracks_cpu(procs, tmp_path, data):
    train, val = data
    cpu = fleet(procs, 1, "cpu", "c")
    ref = run(procs, cpu, tmp_path, tiny_spec(train, val, STEPS, 0, 1), "cpu")
    gpu = fleet(procs, 1, "cuda:0", "g")
    got = run(procs, gpu, tmp_path, tiny_spec(train, val, STEPS, 0, 1), "gpu")
    r32 = rel_diffs(got, ref, "fp32")
    bf = run(procs, gpu, tmp_path, tiny_spec(train, val, STEPS, 0, 1, bf16={"enabled": True}),
             "gpu-bf16")
    r16 = rel_diffs(bf, ref, "bf16")
    print(f"last loss cpu {ref[STEPS]:.4f} gpu {got[STEPS]:.4f} bf16 {bf[STEPS]:.4f}")
    assert max(r32[:20]) <= 1e-5, r32[:20]
    assert max(r32) <= 1e-2 and r32[-1] <= 3e-3, r32
    assert max(r16[:10]) <= 5e-4, r16[:10]
    assert max(r16) <= 3e-2, r16
    assert bf[STEPS] < bf[1] - 1.0


def test_gpu_zero_stages(procs, tmp_path, data):
    train, val = data
    gpu1 = fleet(procs, 1, "cuda:0", "o")
    ref = run_steps(procs, gpu1, tmp_path, tiny_spec(train, val, ID_STEPS, 0, 1), "gpu-1",
                    ID_STEPS)
    gpu = fleet(procs, 2, "cuda:0", "g", own_devices=SIM)
    stages = (0, 1, 2, 3)
    for stage in stages:
        got = run_steps(procs, gpu, tmp_path, tiny_spec(train, val, ID_STEPS, stage, 2),
                        f"gpu-s{stage}", ID_STEPS)
        rel = rel_diffs(got, ref, f"stage {stage}, 2 GPU workers vs 1", ID_STEPS)
        assert all(got[s] == ref[s] for s in range(1, ID_STEPS + 1)), rel
    # Without overlap_comm the collectives wait for the kernels on the host.
    got = run_steps(procs, gpu, tmp_path,
                    tiny_spec(train, val, ID_STEPS, 3, 2,
                              zero_optimization={"stage": 3, "overlap_comm": False}),
                    "gpu-s3-sync", ID_STEPS)
    assert all(got[s] == ref[s] for s in range(1, ID_STEPS + 1)), \
        rel_diffs(got, ref, "stage 3 without overlap_comm", ID_STEPS)
    runs = len(stages) + 1
    used = comm_used(procs, ["g0", "g1"])
    print("collectives by worker:", used)
    # Every stage runs the micro-steps from CUDA graphs, recorded once in
    # each generation, with ZeRO's gathers and reductions between them, and
    # gives the same bits as above.
    recorded = {nm: worker_log(procs, nm).count("CUDA graphs: a step recorded")
                for nm in ("o0", "g0", "g1")}
    print("steps recorded as CUDA graphs, by worker:", recorded)
    assert recorded == {"o0": 1, "g0": runs, "g1": runs}, recorded
    want = "NCCL" if SIM else "TCP ring"  # one real GPU: shared, so the ring
    assert all(len(u) == runs and all(c == want for _, c in u) for u in used.values()), used
    if SIM:  # over NCCL the collectives ran beside the kernels (engine/zero.h)
        for nm in ("g0", "g1"):
            ordered = re.findall(r"stage (\d): collectives in stream order", worker_log(procs, nm))
            assert ordered == [str(s) for s in stages], (nm, ordered)


def memory_report(procs, name):
    import json
    with open(os.path.join(procs.tmp, "work", name, "zero_memory.json")) as f:
        return json.load(f)


def bf16_state_bytes(stage, n, psi):
    """Model-state bytes per rank with bf16 storage (docs/zero.md): an fp32
    master (whole at stage 0, else the shard) and a bf16 working copy
    (whole at stages 0-2, the shard at 3), gradients and Adam as with fp32."""
    return {0: 26 * psi, 1: 14 * psi + 12 * psi / n, 2: 2 * psi + 20 * psi / n,
            3: 22 * psi / n}[stage]


@pytest.mark.parametrize("comm", ["nccl", "ring"] if SIM else ["ring"])
def test_gpu_bf16_storage_stages_and_memory(procs, tmp_path, data, comm):
    """comm: the two workers on devices of their own (NCCL, on the stand-in)
    or sharing cuda:0 (the TCP ring, the collectives staged through host
    memory: one real GPU)."""
    train, val = data
    bf16 = {"enabled": True}
    gpu1 = fleet(procs, 1, "cuda:0", "b")
    n = ID_STEPS
    ref = run_steps(procs, gpu1, tmp_path, tiny_spec(train, val, n, 0, 1, bf16=bf16), "bf-1", n)
    fp32_acts = None
    gpu = fleet(procs, 2, "cuda:0", "d", own_devices=comm == "nccl")
    for stage in (0, 1, 2, 3):
        if stage == 0:  # the fp32 figures of the same job, for the activations
            run_steps(procs, gpu, tmp_path, tiny_spec(train, val, n, 0, 2), "fp32-s0", n)
            fp32_acts = memory_report(procs, "d0")["activation_bytes"]
        got = run_steps(procs, gpu, tmp_path, tiny_spec(train, val, n, stage, 2, bf16=bf16),
                        f"bf-s{stage}", n)
        rel = rel_diffs(got, ref, f"bf16 storage, stage {stage}, 2 GPU workers vs 1", n)
        assert all(got[s] == ref[s] for s in range(1, n + 1)), rel
        for name in ("d0", "d1"):
            m = memory_report(procs, name)
            psi, pad = m["psi"], m["padding"]
            held = m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]
            want = bf16_state_bytes(stage, 2, psi)
            print(f"stage {stage} {name}: states {held} bytes, formula {want:.0f}, "
                  f"activations {m['activation_bytes']} (fp32 {fp32_acts})")
            assert abs(held - want) <= 0.01 * want + 26 * pad, (stage, name, held, want, m)
            assert m["estimated_states_bytes"] == held + m["inflight_bytes"] + m["scratch_bytes"]
            assert m["estimated_activation_bytes"] > m["activation_bytes"]
            assert m["activation_bytes"] < 0.6 * fp32_acts, (m["activation_bytes"], fp32_acts)
    used = comm_used(procs, ["d0", "d1"])
    assert all(c == ("NCCL" if comm == "nccl" else "TCP ring") for u in used.values() for _, c in u), used
    assert ref[n] < ref[1] - (1.0 if n >= 40 else 0.3)  # it learns


@pytest.mark.skipif(not SIM, reason="needs three GPUs; runs on the stand-in")
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-checkpoints"])
def test_gpu_nccl_kill9(procs, tmp_path, data, bf16):
    """With bf16 storage the job also checkpoints every 5 steps, so the
    next generation loads the fp32 master from disk and rounds its bf16
    working copy from it (the stage-2 load of engine/zero.c)."""
    train, val = data
    steps = 36
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    ref = run_steps(procs, fleet(procs, 1, "cuda:0", "r"), tmp_path,
                    tiny_spec(train, val, steps, 2, 1, **extra), "ref", steps)
    coord = fleet(procs, 3, "cuda:0", "k", own_devices=True)
    if bf16:
        extra["checkpoint"] = {"dir": str(tmp_path / "ckpt"), "every_steps": 5, "keep_last": 3}
    spec = tiny_spec(train, val, steps, 2, 2, max_workers=3, **extra)
    jid = submit(coord, spec, tmp_path, "kill.json")
    wait_until(lambda: job(coord, jid)["step"] >= 12 and job(coord, jid)["world"] == 3, 300,
               "training on 3 GPU workers")
    coord.workers["k2"].kill()
    j = wait_job(coord, jid, timeout=600)
    assert j["step"] == steps
    got = losses(coord, jid)
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in range(1, steps + 1))
    print(f"kill -9 of a GPU worker: worst relative difference to the run without one {worst:.1e}")
    assert worst <= 1e-4  # as tests/integration/test_elastic.py
    used = comm_used(procs, ["k0", "k1"])
    print("collectives by worker:", used)
    for u in used.values():
        assert len(u) >= 2 and all(c == "NCCL" for _, c in u), used
    logs = worker_log(procs, "k0") + worker_log(procs, "k1")
    if bf16:
        gens = re.findall(r"generation (\d+): rank \d+ of \d+, start step (\d+)", logs)
        print("generations and their start steps:", gens)
        assert any(int(st) > 0 for _, st in gens), "a generation started from a checkpoint"
    assert "ncclAllReduce: remote process exited" in logs or \
        "ncclReduceScatter: remote process exited" in logs or \
        "ncclAllGather: remote process exited" in logs, "the survivors saw NCCL's async error"


def test_mixed_cpu_gpu_generation_uses_the_ring(procs, tmp_path, data):
    """A generation of a CPU worker and a GPU worker runs over the TCP ring
    (NCCL takes GPU ranks only) and trains like CPU workers: the fp64 sums
    are the same, only each rank's kernels round differently."""
    train, val = data
    cpu = fleet(procs, 1, "cpu", "c")
    ref = run(procs, cpu, tmp_path, tiny_spec(train, val, STEPS, 2, 1), "cpu")
    coord = start_fleet(procs, names=["x0", "x1"], extra=("--threads", "1", "--device", "cpu"),
                        extra_by_name={"x1": ("--device", "cuda:0")}, timeout_ms=5000,
                        wait_s=60, name="zcoord-x", db=os.path.join(procs.tmp, "x.db"),
                        env_by_name={"x1": SIM_ENV})
    got = run(procs, coord, tmp_path, tiny_spec(train, val, STEPS, 2, 2), "mixed")
    rel = rel_diffs(got, ref, "CPU + GPU worker vs 1 CPU worker")
    assert max(rel[:20]) <= 1e-5 and max(rel) <= 1e-2, rel
    used = comm_used(procs, ["x0", "x1"])
    print("collectives by worker:", used)
    assert all(len(u) == 1 and u[0][1] == "TCP ring" for u in used.values()), used
    assert "device cpu" in worker_log(procs, "x0"), "one CPU worker"
    assert "device cuda:0" in worker_log(procs, "x1"), "one GPU worker"


@pytest.mark.skipif(not SIM, reason="a worker without NCCL is made on the stand-in")
def test_gpu_worker_without_nccl_gets_the_ring(procs, tmp_path, data):
    """A GPU worker whose NCCL library does not load says so when it
    registers; the coordinator gives its generations the TCP ring, and the
    job trains to the same losses."""
    train, val = data
    coord = fleet(procs, 2, "cuda:0", "n", own_devices=True,
                  env_by_name={"n1": {"ZT_NCCL_LIB": "/nonexistent/libnccl.so.2"}})
    steps = 10
    got = run_steps(procs, coord, tmp_path, tiny_spec(train, val, steps, 2, 2), "no-nccl", steps)
    ref = run_steps(procs, fleet(procs, 1, "cuda:0", "m"), tmp_path,
                    tiny_spec(train, val, steps, 2, 1), "one", steps)
    assert all(got[s] == ref[s] for s in range(1, steps + 1)), (got, ref)
    used = comm_used(procs, ["n0", "n1"])
    assert all(u and all(c == "TCP ring" for _, c in u) for u in used.values()), used
    assert "no NCCL (NCCL backend: cannot load libnccl" in worker_log(procs, "n1")


def test_gpu_diloco_over_nccl(procs, tmp_path, data):
    """DiLoCo (sync.mode "diloco") on GPU workers: each group's inner steps
    on its device, the pseudo-gradient summed by NCCL through a device
    buffer (engine/diloco.c), the losses those of CPU workers running the
    same job. Compression is asked for and, over NCCL, not used (logged)."""
    train, val = data
    steps = 8

    def spec(compression):
        s = tiny_spec(train, val, steps, 0, 2)
        s["sync"] = {"mode": "diloco", "inner_steps": 4, "compression": compression}
        return s
    ref = run_steps(procs, fleet(procs, 2, "cpu", "c"), tmp_path, spec("none"), "cpu", steps)
    gpu = fleet(procs, 2, "cuda:0", "g", own_devices=SIM)
    # int8 goes as fp32 over NCCL; one real GPU shares its device over the
    # TCP ring, where int8 would be used and the losses would differ.
    got = run_steps(procs, gpu, tmp_path, spec("int8" if SIM else "none"), "gpu", steps)
    rel = rel_diffs(got, ref, "DiLoCo, 2 GPU workers vs 2 CPU workers", steps)
    assert max(rel) <= 1e-4, rel
    want = "NCCL" if SIM else "TCP ring"
    used = comm_used(procs, ["g0", "g1"])
    assert all(u and all(c == want for _, c in u) for u in used.values()), used
    if SIM:
        logs = worker_log(procs, "g0") + worker_log(procs, "g1")
        assert "sync.compression: not over NCCL" in logs


def test_gpu_diloco_groups_over_the_ring(procs, tmp_path, data):
    """DiLoCo groups of two GPU workers (sync.group_size 2, ZeRO-2 inside
    each): the coordinator gives the generation the TCP ring (the groups
    are views of its mesh), the device buffers are staged through host
    memory, and the losses are those of two CPU workers, each a group of
    its own."""
    train, val = data
    steps = 8

    def spec(workers, S):
        s = tiny_spec(train, val, steps, 2 if S > 1 else 0, workers)
        s["sync"] = {"mode": "diloco", "inner_steps": 4, "group_size": S}
        return s
    ref = run_steps(procs, fleet(procs, 2, "cpu", "c"), tmp_path, spec(2, 1), "cpu", steps)
    gpu = fleet(procs, 4, "cuda:0", "g", own_devices=SIM)
    got = run_steps(procs, gpu, tmp_path, spec(4, 2), "gpu", steps)
    rel = rel_diffs(got, ref, "DiLoCo, 2 groups of 2 GPU workers vs 2 CPU workers", steps)
    assert max(rel) <= 1e-4, rel
    used = comm_used(procs, ["g0", "g1", "g2", "g3"])
    assert all(u and all(c == "TCP ring" for _, c in u) for u in used.values()), used
