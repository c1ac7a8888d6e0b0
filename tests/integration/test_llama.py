"""The Llama architecture (model.arch "llama") against an independent
PyTorch Llama.

The reference below is written from Hugging Face's LlamaForCausalLM
semantics (RMSNorm in fp32, rotary embeddings in the rotate_half
convention, grouped-query attention by repeat_kv, a SwiGLU MLP, optional
q/k/v biases as Qwen2 has, tied or untied head), not from our code. The
test writes random weights in Hugging Face's safetensors layout, starts
zsolo from them (init.from_safetensors) and compares the first step's loss
and gradient norm and the loss after one AdamW step. The data set holds
exactly one batch of samples, so the batch is the whole set whatever the
shuffle, and its mean loss does not depend on the order.
"""
import json
import math
import os
import struct
import subprocess

import pytest

from ztest import (BIN, byte_dataset, losses, start_fleet, submit, tiny_spec, wait_job,
                   wait_until, job, write_shard)

torch = pytest.importorskip("torch", reason="the reference needs python3-torch")

B, T, V = 4, 32, 257
CONFIGS = {
    # Llama: grouped-query attention (2 K/V heads for 4 query heads), untied head,
    # Llama 3's rope_scaling scaled so that T's frequencies fall in all three
    # of its bands (wavelengths below 16 kept, above 64 divided, between blended).
    "llama": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, head_dim=16,
                  intermediate_size=96, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, attention_bias=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}),
    # Qwen2-like: q/k/v biases, tied head, one K/V head, head_dim != n_embd / n_head.
    "qwen2": dict(n_layer=2, n_head=4, n_kv_head=1, n_embd=48, head_dim=8,
                  intermediate_size=80, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, attention_bias=True),
}


def weights(c, seed):
    g = torch.Generator().manual_seed(seed)
    C, A, KV, F = c["n_embd"], c["n_head"] * c["head_dim"], c["n_kv_head"] * c["head_dim"], \
        c["intermediate_size"]

    def rnd(*shape, std=0.05):
        return (torch.randn(*shape, generator=g) * std).float()
    w = {"model.embed_tokens.weight": rnd(V, C, std=0.5), "model.norm.weight": 1 + rnd(C)}
    if not c["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(V, C, std=0.2)
    for i in range(c["n_layer"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rnd(C)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(C)
        w[p + "self_attn.q_proj.weight"] = rnd(A, C, std=0.15)
        w[p + "self_attn.k_proj.weight"] = rnd(KV, C, std=0.15)
        w[p + "self_attn.v_proj.weight"] = rnd(KV, C, std=0.15)
        w[p + "self_attn.o_proj.weight"] = rnd(C, A, std=0.15)
        if c["attention_bias"]:
            w[p + "self_attn.q_proj.bias"] = rnd(A)
            w[p + "self_attn.k_proj.bias"] = rnd(KV)
            w[p + "self_attn.v_proj.bias"] = rnd(KV)
        w[p + "mlp.gate_proj.weight"] = rnd(F, C, std=0.15)
        w[p + "mlp.up_proj.weight"] = rnd(F, C, std=0.15)
        w[p + "mlp.down_proj.weight"] = rnd(C, F, std=0.15)
    return w


def write_safetensors(path, tensors, bf16=False):
    """The safetensors format: an 8-byte little-endian header length, a JSON
    header of dtype, shape and data offsets, then the raw data (F32, or
    BF16: the upper halves of the fp32 values, rounded to nearest even)."""
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        if bf16:
            b = t.contiguous().bfloat16().view(torch.int16).numpy().astype("<i2").tobytes()
        else:
            b = t.contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "BF16" if bf16 else "F32", "shape": list(t.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def zsolo(cwd, spec, *args, name="spec.json", timeout=300):
    """Writes spec as cwd/name and runs zsolo on it there."""
    (cwd / name).write_text(json.dumps(spec))
    return subprocess.run([os.path.join(BIN, "zsolo"), name, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def records(r):
    return [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]


def bad_init_spec(c, init):
    """A spec of config c that starts from init, on a shard train_000000.bin."""
    model = {"arch": "llama", "seq_len": T, "vocab_size": V, **c}
    return {"name": "bad", "steps": 2, "model": model, "data": {"train": "train_*.bin"},
            "init": init, "train_micro_batch_size_per_gpu": 1}


class Llama(torch.nn.Module):
    """Hugging Face's LlamaForCausalLM, in fp32, from its definition."""

    def __init__(self, c, w):
        super().__init__()
        self.c = c
        self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v.clone())
                                         for k, v in w.items()})

    def w(self, name):
        return self.p[name.replace(".", "__")]

    def rms(self, x, wt):
        var = x.pow(2).mean(-1, keepdim=True)
        return wt * (x * torch.rsqrt(var + self.c["rms_norm_eps"]))

    def rope(self, x):  # x [B, heads, T, HD]
        hd = x.shape[-1]
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        rs = self.c.get("rope_scaling")
        if rs:  # Hugging Face's "llama3" rope_type, from its definition
            old, lo, hi = (rs["original_max_position_embeddings"], rs["low_freq_factor"],
                           rs["high_freq_factor"])
            wavelen = 2 * math.pi / inv
            smooth = (old / wavelen - lo) / (hi - lo)
            inv = torch.where(wavelen > old / lo, inv / rs["factor"],
                              torch.where(wavelen < old / hi, inv,
                                          (1 - smooth) * inv / rs["factor"] + smooth * inv))
        freqs = torch.outer(torch.arange(x.shape[2]).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        half = hd // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def forward(self, idx, targets):
        c = self.c
        nh, kv, hd = c["n_head"], c["n_kv_head"], c["head_dim"]
        Bq, Tq = idx.shape
        x = self.w("model.embed_tokens.weight")[idx]
        mask = torch.full((Tq, Tq), float("-inf")).triu(1)
        for i in range(c["n_layer"]):
            p = f"model.layers.{i}."
            h = self.rms(x, self.w(p + "input_layernorm.weight"))

            def proj(n):
                b = self.w(p + f"self_attn.{n}_proj.bias") if c["attention_bias"] else None
                return torch.nn.functional.linear(h, self.w(p + f"self_attn.{n}_proj.weight"), b)
            q = proj("q").view(Bq, Tq, nh, hd).transpose(1, 2)
            k = proj("k").view(Bq, Tq, kv, hd).transpose(1, 2)
            v = proj("v").view(Bq, Tq, kv, hd).transpose(1, 2)
            q, k = self.rope(q), self.rope(k)
            k = k.repeat_interleave(nh // kv, dim=1)  # repeat_kv
            v = v.repeat_interleave(nh // kv, dim=1)
            att = (q @ k.transpose(-1, -2)) / math.sqrt(hd) + mask
            y = (att.softmax(-1) @ v).transpose(1, 2).reshape(Bq, Tq, nh * hd)
            x = x + torch.nn.functional.linear(y, self.w(p + "self_attn.o_proj.weight"))
            h = self.rms(x, self.w(p + "post_attention_layernorm.weight"))
            gate = torch.nn.functional.linear(h, self.w(p + "mlp.gate_proj.weight"))
            up = torch.nn.functional.linear(h, self.w(p + "mlp.up_proj.weight"))
            x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up,
                                               self.w(p + "mlp.down_proj.weight"))
        x = self.rms(x, self.w("model.norm.weight"))
        head = self.w("model.embed_tokens.weight" if c["tie_word_embeddings"] else "lm_head.weight")
        logits = x @ head.t()
        return torch.nn.functional.cross_entropy(logits.view(-1, V), targets.view(-1))


def hf_config(c):
    """config.json as Hugging Face writes it for such a model."""
    cfg = {"architectures": ["Qwen2ForCausalLM" if c["attention_bias"] else "LlamaForCausalLM"],
           "hidden_size": c["n_embd"], "num_hidden_layers": c["n_layer"],
           "num_attention_heads": c["n_head"], "num_key_value_heads": c["n_kv_head"],
           "head_dim": c["head_dim"], "intermediate_size": c["intermediate_size"],
           "vocab_size": V, "rope_theta": c["rope_theta"], "rms_norm_eps": c["rms_norm_eps"],
           "tie_word_embeddings": c["tie_word_embeddings"], "max_position_embeddings": 4096,
           "rope_scaling": c.get("rope_scaling"), "hidden_act": "silu",
           "torch_dtype": "bfloat16"}
    if not c["attention_bias"]:
        cfg["attention_bias"] = False
    return cfg


def write_pretrained(d, c, w):
    """A Hugging Face directory: config.json, two shards (the second in
    bf16) and their index. Returns the weights as the model sees them."""
    os.makedirs(d)
    (d / "config.json").write_text(json.dumps(hf_config(c)))
    names = sorted(w)
    half = {n: w[n] for n in names[:len(names) // 2]}
    rest = {n: w[n] for n in names[len(names) // 2:]}
    write_safetensors(d / "model-00001-of-00002.safetensors", half)
    write_safetensors(d / "model-00002-of-00002.safetensors", rest, bf16=True)
    wm = {n: "model-00001-of-00002.safetensors" for n in half}
    wm.update({n: "model-00002-of-00002.safetensors" for n in rest})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                "weight_map": wm}))
    return {**half, **{n: t.bfloat16().float() for n, t in rest.items()}}


@pytest.mark.parametrize("how", ["file", "pretrained"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_llama_matches_an_independent_pytorch_llama(tmp_path, name, how):
    """init.from_safetensors (one F32 file) or init.from_pretrained (a
    Hugging Face directory: config.json, an index and two shards, one in
    bf16)."""
    c = CONFIGS[name]
    torch.manual_seed(0)
    w = weights(c, seed=11)
    if how == "file":
        write_safetensors(tmp_path / "init.safetensors", w)
        init = {"from_safetensors": "init.safetensors"}
    else:
        w = write_pretrained(tmp_path / "hf", c, w)
        init = {"from_pretrained": "hf"}
    # Exactly B samples: the one batch is the whole data set.
    toks = torch.randint(0, V, (B * T + 1,), generator=torch.Generator().manual_seed(5)).tolist()
    write_shard(str(tmp_path / "train_000000.bin"), toks)
    lr, betas, eps, wd = 1e-3, (0.9, 0.95), 1e-8, 0.1
    model = {"arch": "llama", "seq_len": T, "vocab_size": V}
    model.update({k: v for k, v in c.items()})
    spec = {"name": name, "seed": 1, "steps": 2, "model": model,
            "data": {"train": "train_*.bin"}, "init": init,
            "train_micro_batch_size_per_gpu": B, "train_batch_size": B,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas),
                                                      "eps": eps, "weight_decay": wd}}}
    r = zsolo(tmp_path, spec, "--json", "--log-every", "1", "--threads", "2")
    assert r.returncode == 0, r.stderr
    recs = records(r)
    assert [x["step"] for x in recs] == [1, 2], r.stdout

    ref = Llama(c, w)
    data = torch.tensor(toks)
    idx = torch.stack([data[i * T:(i + 1) * T] for i in range(B)])
    tgt = torch.stack([data[i * T + 1:(i + 1) * T + 1] for i in range(B)])
    loss1 = ref(idx, tgt)
    loss1.backward()
    gnorm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in ref.parameters()))
    decay = [p for p in ref.parameters() if p.dim() == 2]
    nodecay = [p for p in ref.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                             {"params": nodecay, "weight_decay": 0.0}], lr=lr, betas=betas,
                            eps=eps)
    opt.step()
    with torch.no_grad():
        loss2 = ref(idx, tgt)

    check_two_steps(recs, loss1, gnorm, loss2, moved=1e-3)


def check_two_steps(recs, loss1, gnorm, loss2, moved):
    """zsolo's first two records against the reference's first loss, its
    gradient norm and the loss after one AdamW step; the step moved the
    loss by more than `moved` (far more than the tolerances)."""
    def rel(a, b):
        return abs(a - b) / abs(b)
    assert rel(recs[0]["loss"], float(loss1)) < 2e-6, (recs[0], float(loss1))
    assert rel(recs[0]["grad_norm"], gnorm) < 1e-5, (recs[0], gnorm)
    assert rel(recs[1]["loss"], float(loss2)) < 1e-5, (recs[1], float(loss2))
    assert rel(float(loss2), float(loss1)) > moved


def llama_spec(train, val, steps, stage, workers, **kw):
    s = tiny_spec(train, val, steps, stage=stage, workers=workers, **kw)
    s["model"] = {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32,
                  "intermediate_size": 64, "seq_len": 32, "vocab_size": 257}
    return s


def test_llama_under_zero_elastic_and_checkpoints(procs, tmp_path):
    """A llama job trains under zcoord like GPT-2: ZeRO-3 on two workers
    gives the single-process losses bit for bit; with activation
    checkpointing too; and a worker killed mid-run costs a re-form from
    the last checkpoint, not a different loss."""
    train, val = byte_dataset(str(tmp_path / "data"), limit=200_000)
    coord = start_fleet(procs, 2)
    ref = llama_spec(train, val, 60, 0, 1)
    jr = submit(coord, ref, tmp_path, "ref.json")
    wait_job(coord, jr, timeout=120)
    want = losses(coord, jr)
    assert len(want) == 60
    for name, stage, extra in (("z3", 3, {}), ("z2ac", 2, {"activation_checkpointing": True})):
        s = llama_spec(train, val, 60, stage, 2, **extra)
        jid = submit(coord, s, tmp_path, name + ".json")
        wait_job(coord, jid, timeout=180)
        assert losses(coord, jid) == want, name
    s = llama_spec(train, val, 400, 1, 1, max_workers=2,
                   checkpoint={"dir": str(tmp_path / "ck"), "every_steps": 20})
    s["elastic"] = {"min_workers": 1, "max_workers": 2}
    jid = submit(coord, s, tmp_path, "kill.json")
    wait_until(lambda: job(coord, jid)["world"] == 2 and job(coord, jid)["step"] >= 50, 60,
               "two workers training")
    coord.workers["w1"].kill()
    wait_job(coord, jid, timeout=180)
    ref = llama_spec(train, val, 400, 0, 1)
    jr = submit(coord, ref, tmp_path, "ref400.json")
    wait_job(coord, jr, timeout=180)
    assert losses(coord, jid) == losses(coord, jr)


def test_llama_spec_errors_name_the_field(tmp_path):
    base = {"name": "e", "steps": 2, "data": {"train": "x_*.bin"},
            "train_micro_batch_size_per_gpu": 1, "train_batch_size": 1}
    cases = [({"arch": "mamba"}, "model.arch"),
             ({"n_kv_head": 2}, "model.n_kv_head: a llama field"),
             ({"arch": "llama", "n_kv_head": 3}, "multiple of n_kv_head"),
             ({"arch": "llama", "intermediate_size": 64, "head_dim": 7}, "head_dim"),
             ({"arch": "llama"}, "model.intermediate_size")]
    for extra, want in cases:
        m = {"n_layer": 1, "n_head": 4, "n_embd": 32, "seq_len": 8, "vocab_size": 257}
        if extra.get("arch") == "llama" and "intermediate_size" not in extra and len(extra) > 1:
            m["intermediate_size"] = 64
        m.update(extra)
        r = zsolo(tmp_path, dict(base, model=m), name="s.json", timeout=60)
        assert r.returncode != 0 and want in r.stderr, (extra, r.stderr)


def test_a_pretrained_directory_that_disagrees_is_refused_naming_each_field(tmp_path):
    c = CONFIGS["llama"]
    write_pretrained(tmp_path / "hf", c, weights(c, seed=3))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.update(num_key_value_heads=4, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    write_shard(str(tmp_path / "train_000000.bin"), list(range(200)))
    spec = bad_init_spec(c, {"from_pretrained": "hf"})
    r = zsolo(tmp_path, spec, timeout=60)
    assert r.returncode != 0
    assert "model.n_kv_head is 2 in the spec, 4 in config.json" in r.stderr, r.stderr
    assert 'rope_type "yarn" is not supported' in r.stderr, r.stderr
    cfg.update(num_key_value_heads=2, rope_scaling=None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    r = zsolo(tmp_path, spec, timeout=60)
    assert r.returncode != 0
    assert "model.rope_scaling is set in the spec, config.json has none" in r.stderr, r.stderr
    # An index that puts a tensor in the wrong shard is refused, naming it.
    cfg.update(rope_scaling=c["rope_scaling"])
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    idx = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    moved = sorted(idx["weight_map"])[0]
    idx["weight_map"][moved] = "model-00002-of-00002.safetensors"
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(idx))
    r = zsolo(tmp_path, spec, timeout=60)
    assert r.returncode != 0 and moved in r.stderr, r.stderr


def read_safetensors(path):
    """name -> (dtype, shape, raw bytes) of a safetensors file."""
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    hdr = json.loads(data[8:8 + n])
    body = data[8 + n:]
    return {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in hdr.items() if k != "__metadata__"}


def hf_model(d):
    """A Hugging Face directory loaded as transformers would: the config's
    class decides which tensors the model has (LlamaForCausalLM's
    attention_bias gives q, k, v and o projections biases; Qwen2ForCausalLM
    has q, k and v biases and no attention_bias field), and every tensor of
    the files must be one of them, and every one of them in the files.
    Returns our reference's config and weights."""
    cfg = json.loads((d / "config.json").read_text())
    arch = cfg["architectures"][0]
    qwen2 = arch == "Qwen2ForCausalLM"
    assert arch in ("LlamaForCausalLM", "Qwen2ForCausalLM"), arch
    assert cfg["model_type"] == ("qwen2" if qwen2 else "llama")
    if qwen2:
        assert "attention_bias" not in cfg
    bias = qwen2 or cfg.get("attention_bias", False)
    c = dict(n_layer=cfg["num_hidden_layers"], n_head=cfg["num_attention_heads"],
             n_kv_head=cfg["num_key_value_heads"], n_embd=cfg["hidden_size"],
             head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
             intermediate_size=cfg["intermediate_size"], rope_theta=cfg["rope_theta"],
             rms_norm_eps=cfg["rms_norm_eps"], tie_word_embeddings=cfg["tie_word_embeddings"],
             attention_bias=bias, rope_scaling=cfg.get("rope_scaling"))
    want = {"model.embed_tokens.weight", "model.norm.weight"}
    if not c["tie_word_embeddings"]:
        want.add("lm_head.weight")
    for i in range(c["n_layer"]):
        p = f"model.layers.{i}."
        want |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                 "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                 "mlp.down_proj.weight")}
        for proj in ("q", "k", "v", "o"):
            want.add(p + f"self_attn.{proj}_proj.weight")
            if bias and (proj != "o" or not qwen2):
                want.add(p + f"self_attn.{proj}_proj.bias")
    got = read_safetensors(d / "model.safetensors")
    assert set(got) == want, (sorted(set(got) - want), sorted(want - set(got)))
    w = {n: torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)
         for n, (dtype, shape, raw) in got.items()}
    return c, w


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_export_of_an_import_is_the_same_model(procs, tmp_path, name):
    """A Hugging Face directory imported (init.from_pretrained), trained with
    lr 0 under zcoord and exported (zctl export) comes back tensor for
    tensor, with a config.json that imports again to the same losses. The
    export loads as transformers would load it (a model with q/k/v biases
    is a Qwen2ForCausalLM: LlamaForCausalLM's attention_bias would give
    o_proj a bias the file does not have) into the independent model, which
    computes the same loss from it as from the original; and config.json
    says what its source said (rms_norm_eps as written,
    max_position_embeddings)."""
    c = CONFIGS[name]
    w = write_pretrained(tmp_path / "hf", c, weights(c, seed=21))
    toks = torch.randint(0, V, (20 * T + 1,), generator=torch.Generator().manual_seed(2)).tolist()
    write_shard(str(tmp_path / "train_000000.bin"), toks)
    model = {"arch": "llama", "seq_len": T, "vocab_size": V, **c}
    spec = {"name": "rt", "seed": 1, "steps": 3, "model": model,
            "data": {"train": str(tmp_path / "train_*.bin")},
            "init": {"from_pretrained": str(tmp_path / "hf")},
            "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.1}},
            "checkpoint": {"dir": str(tmp_path / "ck"), "every_steps": 100}}
    coord = start_fleet(procs, 1)
    jid = submit(coord, spec, tmp_path)
    wait_job(coord, jid)
    out = tmp_path / "export"
    r = subprocess.run([os.path.join(BIN, "zctl"), "--coordinator", coord.grpc, "export",
                        str(jid), "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = read_safetensors(out / "model.safetensors")
    assert sorted(got) == sorted(w)  # tied: no lm_head.weight
    for name, t in w.items():
        dtype, shape, raw = got[name]
        assert dtype == "F32" and shape == list(t.shape), name
        assert raw == t.contiguous().numpy().astype("<f4").tobytes(), name
    text = (out / "config.json").read_text()
    cfg = json.loads(text)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["tie_word_embeddings"]) == (
        c["n_kv_head"], c["head_dim"], c["tie_word_embeddings"])
    assert cfg["max_position_embeddings"] == 4096 and cfg["rms_norm_eps"] == c["rms_norm_eps"]
    assert f'"rms_norm_eps":{c["rms_norm_eps"]:g},' in "".join(text.split()), text
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (256, 256)  # the byte tokenizer's
    c2, w2 = hf_model(out)
    assert c2["attention_bias"] == c["attention_bias"]
    idx = torch.randint(0, V, (2, T + 1), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        inp, tgt = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
        want_loss = Llama(c, w)(inp, tgt)
        got_loss = Llama(c2, w2)(inp, tgt)
    assert torch.equal(want_loss, got_loss), (want_loss, got_loss)
    # The export is a starting point again: the same first loss as the original.
    losses_of = []
    for src in ("hf", "export"):
        s = dict(spec, init={"from_pretrained": str(tmp_path / src)}, steps=1)
        del s["checkpoint"]
        r = zsolo(tmp_path, s, "--json", name=f"{src}.json", timeout=120)
        assert r.returncode == 0, r.stderr
        losses_of.append([x["loss"] for x in records(r)])
    assert losses_of[0] == losses_of[1] and len(losses_of[0]) == 1


def test_the_llama_example_trains(tmp_path):
    """examples/llama-tiny.json, on byte data of its shape, learns."""
    from ztest import SRC
    spec = json.load(open(os.path.join(SRC, "examples", "llama-tiny.json")))
    train, val = byte_dataset(str(tmp_path / "data"), limit=200_000)
    spec["data"] = {"train": train, "val": val}
    spec["steps"] = 40
    spec["scheduler"]["params"]["total_num_steps"] = 40
    r = zsolo(tmp_path, spec, "--json", "--log-every", "1")
    assert r.returncode == 0, r.stderr
    recs = records(r)
    assert len(recs) == 40 and recs[-1]["loss"] < recs[0]["loss"] - 1.0, (recs[0], recs[-1])


def test_every_bad_tensor_is_named_in_one_error(tmp_path):
    """A file with a tensor missing, one misshaped and one the model does
    not have: the one error names all three."""
    c = CONFIGS["llama"]
    w = weights(c, seed=4)
    del w["model.layers.1.mlp.up_proj.weight"]
    w["model.layers.0.self_attn.k_proj.weight"] = w["model.layers.0.self_attn.k_proj.weight"][:8]
    w["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    write_safetensors(tmp_path / "bad.safetensors", w)
    write_shard(str(tmp_path / "train_000000.bin"), list(range(200)))
    r = zsolo(tmp_path, bad_init_spec(c, {"from_safetensors": "bad.safetensors"}), timeout=60)
    assert r.returncode != 0
    for name in ("model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.0.mlp.extra.weight"):
        assert name in r.stderr, (name, r.stderr)


def test_the_model_comes_from_config_json(tmp_path):
    """init.from_pretrained reads the model from config.json, as Hugging
    Face's from_pretrained does: a spec that gives only seq_len trains the
    same first step as one that repeats every field; a field that
    contradicts config.json names both values; seq_len may not pass
    max_position_embeddings; an activation other than SiLU is refused by
    name; rope_scaling {"rope_type": "default"} is no scaling."""
    c = CONFIGS["llama"]  # rms_norm_eps 1e-5, an untied head, llama3 rope_scaling
    write_pretrained(tmp_path / "hf", c, weights(c, seed=8))
    toks = torch.randint(0, V, (20 * T + 1,), generator=torch.Generator().manual_seed(3)).tolist()
    write_shard(str(tmp_path / "train_000000.bin"), toks)
    full = bad_init_spec(c, {"from_pretrained": "hf"})
    short = dict(full, model={"seq_len": T})
    got = []
    for name, spec in (("full", full), ("short", short)):
        r = zsolo(tmp_path, spec, "--json", name=f"{name}.json", timeout=120)
        assert r.returncode == 0, (name, r.stderr)
        got.append([x["loss"] for x in records(r)])
    assert got[0] == got[1] and len(got[0]) == 2, got

    def refused(model, *want, cfg_dir="hf"):
        spec = dict(full, model=model, init={"from_pretrained": cfg_dir})
        r = zsolo(tmp_path, spec, timeout=60)
        assert r.returncode != 0
        for w in want:
            assert w in r.stderr, (w, r.stderr)
    refused({"seq_len": T, "rms_norm_eps": 1e-6},
            "model.rms_norm_eps is 1e-06 in the spec, 1e-05 in config.json")
    refused({"seq_len": T, "n_layer": 3, "tie_word_embeddings": True},
            "model.n_layer is 3 in the spec, 2 in config.json",
            "model.tie_word_embeddings is true in the spec, false in config.json")
    refused({"seq_len": 8192}, "model.seq_len 8192 is above config.json's max_position_embeddings 4096")
    cfg = hf_config(c)
    (tmp_path / "gelu").mkdir()
    (tmp_path / "gelu" / "config.json").write_text(json.dumps(dict(cfg, hidden_act="gelu")))
    refused({"seq_len": T}, 'hidden_act is "gelu", not "silu" (not supported)', cfg_dir="gelu")
    plain = dict(c, rope_scaling=None)
    d = tmp_path / "plain"
    write_pretrained(d, plain, weights(plain, seed=8))
    (d / "config.json").write_text(json.dumps(dict(hf_config(plain),
                                                   rope_scaling={"rope_type": "default"})))
    r = zsolo(tmp_path, dict(short, init={"from_pretrained": "plain"}), "--json",
              name="plain.json", timeout=120)
    assert r.returncode == 0, r.stderr
