"""LoRA fine-tuning (the spec's lora section) against an independent
PyTorch LoRA, and under zcoord.

The reference is test_llama.py's PyTorch Llama (written from Hugging
Face's semantics) with PEFT's LoRA written here from its definition: each
adapted projection computes x W^T + s x A^T B^T, s = alpha / r, with W
frozen and only A and B trained. The test writes a random base model in
Hugging Face's layout and random adapters in PEFT's
adapter_model.safetensors layout (B not zero, so that both A and B get
gradients), starts zsolo from them and compares the first step's loss and
gradient norm (over the adapters only) and the loss after one AdamW step.
"""
import json
import math
import os

import pytest

from ztest import BIN, byte_dataset, losses, start_fleet, submit, tiny_spec, wait_job, \
    wait_until, job, write_shard, zctl_json
from test_llama import (CONFIGS, Llama, check_two_steps, records, weights, write_pretrained,
                        write_safetensors, zsolo)

torch = pytest.importorskip("torch", reason="the reference needs python3-torch")

B, T, V = 4, 32, 257
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def module(t):
    return ("self_attn." if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.") + t


def adapters(c, w, r, targets, seed):
    """PEFT's names and shapes: lora_A [r, in], lora_B [out, r]."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(c["n_layer"]):
        for t in targets:
            W = w[f"model.layers.{i}.{module(t)}.weight"]
            p = f"base_model.model.model.layers.{i}.{module(t)}."
            out[p + "lora_A.weight"] = (torch.randn(r, W.shape[1], generator=g) * 0.1).float()
            out[p + "lora_B.weight"] = (torch.randn(W.shape[0], r, generator=g) * 0.1).float()
    return out


class LoraLlama(Llama):
    """The reference Llama with PEFT LoRA on the given projections: the
    base frozen, A and B trainable."""

    def __init__(self, c, w, ad, scale):
        super().__init__(c, w)
        for p in self.p.values():
            p.requires_grad_(False)
        self.scale = scale
        self.ad = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v.clone())
                                          for k, v in ad.items()})

    def w(self, name):
        base = super().w(name)
        pre = "base_model.model." + name[:-len(".weight")]
        a = pre + ".lora_A.weight"
        if a.replace(".", "__") not in self.ad:
            return base
        A = self.ad[a.replace(".", "__")]
        Bm = self.ad[(pre + ".lora_B.weight").replace(".", "__")]
        return base + self.scale * (Bm @ A)


def lora_spec(c, r, alpha, targets, lr=1e-3, wd=0.1, init=None, steps=2):
    model = {"arch": "llama", "seq_len": T, "vocab_size": V, **c}
    return {"name": "lora", "seed": 1, "steps": steps, "model": model,
            "data": {"train": "train_*.bin"},
            "init": init or {"from_pretrained": "hf", "lora_from": "adapter.safetensors"},
            "lora": {"r": r, "alpha": alpha, "target_modules": targets},
            "train_micro_batch_size_per_gpu": B, "train_batch_size": B,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95],
                                                      "eps": 1e-8, "weight_decay": wd}}}


@pytest.mark.parametrize("name,targets", [("llama", TARGETS), ("qwen2", ["q_proj", "v_proj"])])
def test_lora_matches_an_independent_pytorch_lora(tmp_path, name, targets):
    c = CONFIGS[name]
    r, alpha = 4, 8.0
    w = write_pretrained(tmp_path / "hf", c, weights(c, seed=11))
    ad = adapters(c, w, r, targets, seed=3)
    write_safetensors(tmp_path / "adapter.safetensors", ad)
    toks = torch.randint(0, V, (B * T + 1,), generator=torch.Generator().manual_seed(5)).tolist()
    write_shard(str(tmp_path / "train_000000.bin"), toks)
    lr, wd = 1e-3, 0.1
    rr = zsolo(tmp_path, lora_spec(c, r, alpha, targets, lr, wd), "--json", "--log-every", "1",
               "--threads", "2")
    assert rr.returncode == 0, rr.stderr
    recs = records(rr)
    assert [x["step"] for x in recs] == [1, 2], rr.stdout

    ref = LoraLlama(c, w, ad, alpha / r)
    data = torch.tensor(toks)
    idx = torch.stack([data[i * T:(i + 1) * T] for i in range(B)])
    tgt = torch.stack([data[i * T + 1:(i + 1) * T + 1] for i in range(B)])
    loss1 = ref(idx, tgt)
    loss1.backward()
    assert all(p.grad is None for p in ref.p.values())  # the base is frozen
    gnorm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in ref.ad.values()))
    opt = torch.optim.AdamW(ref.ad.values(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    opt.step()
    with torch.no_grad():
        loss2 = ref(idx, tgt)
    check_two_steps(recs, loss1, gnorm, loss2, moved=1e-4)


def test_lora_spec_errors_name_the_field(tmp_path):
    c = CONFIGS["llama"]
    write_shard(str(tmp_path / "train_000000.bin"), list(range(200)))
    cases = [({"lora": {"r": 4, "dropout": 0.1}}, "lora.dropout"),
             ({"lora": {"r": 4, "target_modules": ["q_proj", "c_attn"]}}, '"c_attn" is not one'),
             ({"lora": {"r": 0}}, "lora.r"),
             ({"init": None}, "lora: needs the model it adapts")]
    for extra, want in cases:
        s = lora_spec(c, 4, 8, ["q_proj"], init={"from_pretrained": "hf"})
        s["lora"].update(extra.get("lora", {}))
        if "init" in extra:
            del s["init"]
        r = zsolo(tmp_path, s, name="s.json", timeout=60)
        assert r.returncode != 0 and want in r.stderr, (extra, r.stderr)


def read_safetensors(path):
    import struct
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    hdr.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"]) for k, v in hdr.items()}


SMALL = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, head_dim=8, intermediate_size=64,
             rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
             attention_bias=False)


def test_lora_fine_tune_survives_a_kill_and_exports(procs, tmp_path):
    """Import a small random llama, LoRA-train it under zcoord with two
    workers (ZeRO-2), kill one mid-run: the job finishes on the losses of
    an undisturbed one-worker run. Then export the adapters (PEFT's
    layout) and the merged model; the merged model, imported again, has
    the job's last validation loss."""
    import subprocess
    train, val = byte_dataset(str(tmp_path / "data"), limit=200_000)
    write_pretrained(tmp_path / "hf", SMALL, weights(SMALL, seed=4))
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]

    def spec(steps, stage, workers, **kw):
        s = tiny_spec(train, val, steps, stage=stage, workers=workers, **kw)
        s["model"] = {"arch": "llama", "seq_len": T, "vocab_size": V, **SMALL}
        s["init"] = {"from_pretrained": str(tmp_path / "hf")}
        s["lora"] = {"r": 4, "alpha": 8, "target_modules": targets}
        s["eval"] = {"every_steps": 40, "batches": 4}
        return s
    coord = start_fleet(procs, 2)
    jr = submit(coord, spec(120, 0, 1), tmp_path, "ref.json")
    wait_job(coord, jr, timeout=180)
    want = losses(coord, jr, val=True)
    assert len(want) == 120 and want[120][1] is not None
    assert want[120][0] < want[1][0]  # the adapters learn
    # ZeRO-3 (adapters sharded, gathered per block) with activation
    # checkpointing (blocks merged again for the recompute): the same losses.
    # The base's blocks are sharded too, each gathered before its merge.
    j3 = submit(coord, spec(120, 3, 2, activation_checkpointing=True), tmp_path, "z3.json")
    wait_job(coord, j3, timeout=180)
    assert losses(coord, j3, val=True) == want
    C, L, F, Vp = SMALL["n_embd"], SMALL["n_layer"], SMALL["intermediate_size"], 320
    qkv = (SMALL["n_head"] + 2 * SMALL["n_kv_head"]) * SMALL["head_dim"]
    block = 2 * C + qkv * C + C * SMALL["n_head"] * SMALL["head_dim"] + 3 * F * C
    base = 2 * Vp * C + C + L * block
    for w in ("w0", "w1"):
        with open(os.path.join(procs.tmp, "work", w, "zero_memory.json")) as f:
            m = json.load(f)
        held = sum(m[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                  "inflight_bytes", "scratch_bytes"))
        assert m["stage"] == 3 and m["world"] == 2 and m["estimated_states_bytes"] == held, m
        # Half of each block (padded to 8), the embedding and head whole,
        # a gathered block in the merge slot and its gradient, the adapters'
        # shard: less than the whole base and its two slots alone.
        assert 4 * (2 * Vp * C + C + L * block // 2 + 2 * block) <= m["params_bytes"] \
            < 4 * (base + 2 * block), (m, base, block)
    s = spec(120, 2, 1, max_workers=2, checkpoint={"dir": str(tmp_path / "ck"), "every_steps": 20})
    s["elastic"] = {"min_workers": 1, "max_workers": 2}
    jid = submit(coord, s, tmp_path, "kill.json")
    wait_until(lambda: job(coord, jid)["world"] == 2 and job(coord, jid)["step"] >= 50, 90,
               "two workers training")
    coord.workers["w1"].kill()
    wait_job(coord, jid, timeout=240)
    assert losses(coord, jid, val=True) == want

    # The worker's allocation counters against the estimate jobs are
    # admitted by (docs/zero.md, "LoRA"): the frozen base, whole, is part
    # of the model states.
    with open(os.path.join(procs.tmp, "work", "w0", "zero_memory.json")) as f:
        m = json.load(f)
    held = sum(m[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                              "inflight_bytes", "scratch_bytes"))
    assert m["estimated_states_bytes"] == held, m
    adapters = L * 4 * sum(o + i for o, i in ((32, 32), (16, 32), (32, 32), (32, 64)))  # q v o down
    assert m["psi"] == adapters + 16  # the two placeholders
    assert m["params_bytes"] >= 4 * base + 8 * block, m

    def export(out, *flags):
        return subprocess.run([os.path.join(BIN, "zctl"), "--coordinator", coord.grpc, "export",
                               str(jid), "--out", str(tmp_path / out), *flags],
                              capture_output=True, text=True, timeout=120)
    r = export("plain")
    assert r.returncode != 0 and "--adapter" in r.stderr and "--merge" in r.stderr, r.stderr
    r = export("adapter", "--adapter")
    assert r.returncode == 0, r.stderr
    assert "adapter_model.safetensors" in r.stdout and " model.safetensors" not in r.stdout, r.stdout
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == (
        "LORA", 4, 8, targets)
    assert cfg["base_model_name_or_path"] == str(tmp_path / "hf")
    got = read_safetensors(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(got) == 2 * SMALL["n_layer"] * len(targets)
    assert got["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"] == ("F32", [4, 64])
    assert got["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] == ("F32", [32, 4])
    r = export("merged", "--merge")
    assert r.returncode == 0, r.stderr
    # Sampling reads the epoch as its base with the adapters merged in.
    r = subprocess.run([os.path.join(BIN, "zctl"), "--coordinator", coord.grpc, "sample", str(jid),
                        "--prompt", "The ", "--tokens", "8"], capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith(b"The "), r.stderr  # bytes: any byte may come
    # The merged model, imported as a plain llama, at lr 0: its validation
    # loss is the LoRA job's last.
    s = spec(1, 0, 1)
    del s["lora"]
    s["init"] = {"from_pretrained": str(tmp_path / "merged")}
    s["optimizer"]["params"]["lr"] = 0.0
    s["scheduler"]["params"].update(warmup_max_lr=0.0, warmup_num_steps=0)
    s["eval"] = {"every_steps": 1, "batches": 4}
    r = zsolo(tmp_path, s, "--json", name="merged.json", timeout=120)
    assert r.returncode == 0, r.stderr
    got_val = records(r)[-1]["val_loss"]
    assert abs(got_val - want[120][1]) <= 1e-5 * abs(want[120][1]), (got_val, want[120][1])
    # A base that is not the one trained on is refused by name.
    write_pretrained(tmp_path / "other", SMALL, weights(SMALL, seed=5))
    r = export("wrong", "--merge", "--base", str(tmp_path / "other"))
    assert r.returncode != 0 and "hash" in r.stderr, r.stderr
    # Training on from the job's epoch with another base is refused by name,
    # and the epoch is left as it was.
    ck = zctl_json(coord.grpc, "checkpoints", str(jid))["checkpoints"]
    last = max((c for c in ck if c["state"] == "committed"), key=lambda c: c["step"])
    before = sorted(os.listdir(last["dir"]))
    s = spec(200, 0, 1, checkpoint={"dir": str(tmp_path / "ck2"), "load": last["dir"]})
    s["init"] = {"from_pretrained": str(tmp_path / "other")}
    j = wait_job(coord, submit(coord, s, tmp_path, "other.json"), states=("failed",))
    assert "not the same base model" in j["message"], j["message"]
    assert sorted(os.listdir(last["dir"])) == before
