"""zsolo: single-process training on real English text (Debian's fortunes).

The tiny configuration (2 layers, 64 wide, byte-level vocabulary of 257)
starts at the uniform loss ln(257) = 5.55 and must get its training and
validation loss below 2.65 nats per byte within 400 steps (about 10 s on
two cores). Runs with the same spec and thread count must print
bit-identical numbers, and with our AVX-512 sgemm the same numbers at any
thread count.
"""
import json
import math
import os
import subprocess

import pytest

from ztest import BIN, SANITIZE

FORTUNES = "/usr/share/games/fortunes"


def run(*args, check=True, timeout=600):
    r = subprocess.run([os.path.join(BIN, args[0]), *map(str, args[1:])], capture_output=True,
                       text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{args[0]} failed ({r.returncode}): {r.stderr}")
    return r


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    if not os.path.isdir(FORTUNES):
        pytest.skip("Debian package fortunes is not installed")
    inputs = sorted(os.path.join(FORTUNES, n) for n in os.listdir(FORTUNES)
                    if "." not in n and n not in ("art", "ascii-art"))
    d = tmp_path_factory.mktemp("fortunes")
    run("zprep", *inputs, "-o", d, "--doc-sep", "%", "--prefix", "f")
    return d


def spec(datadir, tmp_path, steps, **over):
    s = {
        "name": "tiny-test", "seed": 1337, "steps": steps,
        "model": {"n_layer": 2, "n_head": 4, "n_embd": 64, "seq_len": 64, "vocab_size": 257},
        "data": {"train": f"{datadir}/f_train_*.bin", "val": f"{datadir}/f_val_*.bin"},
        "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 0.0003, "warmup_max_lr": 0.003, "warmup_num_steps": 20,
            "total_num_steps": steps, "warmup_type": "linear"}},
        "eval": {"every_steps": 100, "batches": 8},
    }
    s.update(over)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(s))
    return path


def records(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_32bit_shards_train_like_16bit(data, tmp_path):
    """The same corpus in version-2 shards (32-bit tokens: zprep
    --token-bytes 4) trains to the same losses, bit for bit."""
    inputs = sorted(os.path.join(FORTUNES, n) for n in os.listdir(FORTUNES)
                    if "." not in n and n not in ("art", "ascii-art"))
    wide = tmp_path / "wide"
    run("zprep", *inputs, "-o", wide, "--doc-sep", "%", "--prefix", "f", "--token-bytes", "4")
    with open(wide / "f_train_000000.bin", "rb") as f:
        assert int.from_bytes(f.read(8)[4:], "little") == 2
    got = []
    for d in (data, wide):
        r = run("zsolo", spec(d, tmp_path, 30), "--json", "--threads", "2", "--log-every", "1")
        got.append([(x["step"], x["loss"]) for x in records(r.stdout)])
    assert len(got[0]) == 30 and got[0] == got[1]


def test_tiny_learns(data, tmp_path):
    steps = 120 if SANITIZE else 400
    r = run("zsolo", spec(data, tmp_path, steps), "--json", "--threads", "2", "--log-every", "1")
    recs = records(r.stdout)
    assert [x["step"] for x in recs] == list(range(1, steps + 1))
    assert abs(recs[0]["loss"] - math.log(257)) < 0.15
    assert all(math.isfinite(x["loss"]) and x["grad_norm"] > 0 for x in recs)
    assert recs[0]["lr"] == pytest.approx(0.0003 + 0.0027 / 20, rel=1e-6)
    vals = [x["val_loss"] for x in recs if x["val_loss"] is not None]
    assert len(vals) == steps // 100 or len(vals) == steps // 100 + 1
    assert all(x["tokens_per_s"] > 0 for x in recs)
    if SANITIZE:
        return
    tail = sum(x["loss"] for x in recs[-20:]) / 20
    assert tail < 2.65, f"training loss {tail:.3f} after {steps} steps"
    assert vals[-1] < 2.65, f"validation loss {vals[-1]:.3f}"
    assert vals[-1] < vals[0]


def test_deterministic(data, tmp_path):
    path = spec(data, tmp_path, 25, eval={"every_steps": 10, "batches": 2})
    keys = ("step", "loss", "grad_norm", "lr", "val_loss")
    outs = []
    for _ in range(2):
        r = run("zsolo", path, "--json", "--threads", "2")
        outs.append([tuple(x[k] for k in keys) for x in records(r.stdout)])
    assert len(outs[0]) == 25 and outs[0] == outs[1]
    # The plain output prints the same losses with %.9g.
    r = run("zsolo", path, "--threads", "2", "--log-every", "5")
    losses = [float(line.split("| loss ")[1].split()[0]) for line in r.stdout.splitlines()]
    assert losses == [x[1] for x in outs[0] if x[0] == 1 or x[0] % 5 == 0 or x[4] is not None]


def test_thread_count(data, tmp_path):
    """With our AVX-512 sgemm (kernels/cpu/gemm.c), every kernel's result is
    independent of how its rows are split, so 1, 2 and 3 threads print the
    same bits; with OpenBLAS's sgemm that holds only for a fixed count."""
    path = spec(data, tmp_path, 25, eval={"every_steps": 10, "batches": 2})
    keys = ("step", "loss", "grad_norm", "lr", "val_loss")
    outs, impl = [], set()
    for threads in (1, 2, 3):
        r = run("zsolo", path, "--json", "--threads", threads)
        banner = r.stderr.split("(sgemm ")[1]
        assert banner.startswith(("avx512, ", "blas, ")) and f", {threads} threads)" in banner
        impl.add(banner.split(",")[0])
        outs.append([tuple(x[k] for k in keys) for x in records(r.stdout)])
    assert len(impl) == 1 and len(outs[0]) == 25
    if impl == {"blas"}:
        pytest.skip("zt_sgemm is OpenBLAS here (no AVX-512F, or ZT_SGEMM=blas): reproducible "
                    "only for a fixed thread count")
    assert outs[0] == outs[1] == outs[2]


def test_errors(data, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"steps": 1, "stepz": 2}))
    r = run("zsolo", bad, check=False)
    assert r.returncode == 1 and "stepz: unknown key" in r.stderr and "bad.json" in r.stderr
    shard = tmp_path / "broken_train_000000.bin"
    shard.write_bytes(b"\0" * 1030)
    path = spec(data, tmp_path, 30, data={"train": str(shard), "val": str(shard)})
    r = run("zsolo", path, check=False)
    assert r.returncode == 1 and "broken_train_000000.bin" in r.stderr and "magic" in r.stderr
    assert run("zsolo", check=False).returncode == 2
    assert run("zsolo", path, "--threads", "x", check=False).returncode == 2


def test_validation_batches_are_the_first_samples(tmp_path):
    """Validation batch b is samples [b mb, (b + 1) mb) in file order, for b < min(eval.batches,
    n_samples // mb): asking for more batches than the set holds reuses no sample, and data
    after the first K batches is never read."""
    from ztest import english_text, write_shard
    mb, T = 16, 64
    text = list(english_text(60_000))
    train = tmp_path / "v_train_000000.bin"
    write_shard(train, text[10_000:])
    sets = {"exact": text[:3 * mb * T + 1],                # 48 samples: 3 batches
            "longer": text[:3 * mb * T + 1 + 31 * T],      # 79 samples: 4 batches
            "small": text[:10 * T + 1]}                    # 10 samples: less than a batch
    for name, toks in sets.items():
        write_shard(tmp_path / f"{name}_val.bin", toks)

    def val_losses(name, batches):
        path = spec(tmp_path, tmp_path, 25, data={"train": str(train),
                                                 "val": str(tmp_path / f"{name}_val.bin")},
                    eval={"every_steps": 1, "batches": batches})
        r = run("zsolo", path, "--json", "--threads", "2", "--steps", "2", check=False)
        return r, [x["val_loss"] for x in records(r.stdout)]

    _, exact3 = val_losses("exact", 3)
    _, exact_many = val_losses("exact", 1000)
    _, longer3 = val_losses("longer", 3)
    _, longer4 = val_losses("longer", 4)
    assert len(exact3) == 2 and all(math.isfinite(v) for v in exact3)
    assert exact_many == exact3, "batches beyond the set's size reuse no sample"
    assert longer3 == exact3, "samples after the first K batches are not read"
    assert longer4 != exact3
    r, _ = val_losses("small", 2)
    assert r.returncode == 1 and "fewer than one micro batch" in r.stderr
    assert "small_val.bin" in r.stderr
