"""zctl export: a committed epoch as a Hugging Face GPT-2 model directory.

model.safetensors is parsed here independently (8-byte header length, JSON
header, dtypes, shapes, contiguous offsets) and every tensor is compared
with the parameters read straight from the epoch's rank files (their own
JSON index, not our C reader), transposing the Conv1D weights. config.json
and the tokenizer files are checked field by field, and a GPT-2 forward
written here from the Hugging Face definition (config.json + the tensors
by name) must give the loss our engine computes for the same weights.
"""
import glob
import json
import math
import os
import struct
import subprocess
from array import array

from ztest import (BIN, byte_dataset, bytes_to_unicode, start_fleet, submit, tiny_spec, wait_job,
                   zctl, zctl_json)

L, C, NH, T, V = 2, 32, 2, 32, 257


def read_params(epoch):
    """unit -> list of floats (params only), from rank_*.bin and their indexes."""
    units = {}
    for idx in sorted(glob.glob(os.path.join(epoch, "rank_*.json"))):
        meta = json.load(open(idx))
        blob = open(os.path.join(epoch, meta["file"]), "rb").read()
        for r in meta["ranges"]:
            n, off, lo = int(r["n"]), int(r["offset"]), int(r["lo"])
            vals = array("f", blob[off:off + 4 * n])
            u = units.setdefault(int(r["unit"]), {})
            for k in range(n):
                u[lo + k] = vals[k]
    return {u: [d[i] for i in range(len(d))] for u, d in units.items()}


def expected_tensors(units):
    """HF name -> (shape, flat values) from our unit layout ([out, in] weights)."""
    Vp = (V + 63) // 64 * 64
    out = {}
    u0 = units[0]
    out["transformer.wte.weight"] = ([V, C], u0[:V * C])
    out["transformer.wpe.weight"] = ([T, C], u0[Vp * C:Vp * C + T * C])
    block = [("ln_1.weight", 1, C), ("ln_1.bias", 1, C), ("attn.c_attn.weight", 3 * C, C),
             ("attn.c_attn.bias", 1, 3 * C), ("attn.c_proj.weight", C, C),
             ("attn.c_proj.bias", 1, C), ("ln_2.weight", 1, C), ("ln_2.bias", 1, C),
             ("mlp.c_fc.weight", 4 * C, C), ("mlp.c_fc.bias", 1, 4 * C),
             ("mlp.c_proj.weight", C, 4 * C), ("mlp.c_proj.bias", 1, C)]
    for l in range(L):
        u, off = units[1 + l], 0
        for name, rows, cols in block:
            vals = u[off:off + rows * cols]
            off += rows * cols
            if rows == 1:
                out[f"transformer.h.{l}.{name}"] = ([cols], vals)
            else:  # Conv1D: [in, out], transposed
                tv = [vals[j * cols + i] for i in range(cols) for j in range(rows)]
                out[f"transformer.h.{l}.{name}"] = ([cols, rows], tv)
    uf = units[L + 1]
    out["transformer.ln_f.weight"] = ([C], uf[:C])
    out["transformer.ln_f.bias"] = ([C], uf[C:2 * C])
    return out


def parse_safetensors(path):
    raw = open(path, "rb").read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    assert hlen % 8 == 0 and 8 + hlen <= len(raw)
    header = json.loads(raw[8:8 + hlen].decode("utf-8").rstrip(" "))
    data = raw[8 + hlen:]
    meta = header.pop("__metadata__")
    assert meta["format"] == "pt"
    spans = sorted((v["data_offsets"][0], v["data_offsets"][1], k) for k, v in header.items())
    pos = 0
    for b, e, k in spans:
        assert b == pos and e > b, f"{k}: offsets not contiguous"
        pos = e
    assert pos == len(data), "data section size matches the header"
    return header, data


def bf16_to_f32(h):
    return struct.unpack("<f", struct.pack("<I", h << 16))[0]


def check_tensors(path, want, dtype="F32"):
    header, data = parse_safetensors(path)
    assert set(header) == set(want), set(header) ^ set(want)
    for name, (shape, vals) in want.items():
        h = header[name]
        assert h["dtype"] == dtype and h["shape"] == shape, (name, h, shape)
        b, e = h["data_offsets"]
        if dtype == "F32":
            got = array("f", data[b:e])
            assert list(got) == [array("f", [v])[0] for v in vals], name
        else:
            for g, v in zip(array("H", data[b:e]), vals):
                assert abs(bf16_to_f32(g) - v) <= abs(v) * 2 ** -8 + 1e-30, (name, g, v)


def test_export_directory(procs, tmp_path):
    train, val = byte_dataset(str(tmp_path / "data"), 200_000)
    coord = start_fleet(procs, 2, timeout_ms=None)
    spec = tiny_spec(train, val, 30, stage=3, workers=2,
                     checkpoint={"dir": str(tmp_path / "ck"), "every_steps": 20})
    jid = submit(coord, spec, tmp_path)
    wait_job(coord, jid)
    epochs = {c["step"]: c["dir"] for c in zctl_json(coord.grpc, "checkpoints", str(jid))[
        "checkpoints"] if c["state"] == "committed"}

    # Default: the newest committed epoch, the final step.
    out = tmp_path / "exports" / "final"
    r = zctl_json(coord.grpc, "export", str(jid), "--out", str(out))
    assert r["step"] == 30 and r["tokenizer"] == "byte" and r["checkpoint"] == epochs[30]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors",
                                       "special_tokens_map.json", "tokenizer.json",
                                       "tokenizer_config.json"]
    assert r["model_bytes"] == os.path.getsize(out / "model.safetensors")
    check_tensors(str(out / "model.safetensors"), expected_tensors(read_params(epochs[30])))
    cfg = json.load(open(out / "config.json"))
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["model_type"] == "gpt2"
    assert (cfg["vocab_size"], cfg["n_positions"], cfg["n_embd"], cfg["n_layer"],
            cfg["n_head"]) == (V, T, C, L, NH)
    assert cfg["activation_function"] == "gelu_new" and cfg["layer_norm_epsilon"] == 1e-5
    assert cfg["tie_word_embeddings"] is True and cfg["bos_token_id"] == cfg["eos_token_id"] == 256
    # The byte tokenizer.json round-trips every byte: byte-level pre-tokenizer, no merges, so
    # token b is the character GPT-2 shows byte b as, and 256 is the end of text.
    tok = json.load(open(out / "tokenizer.json"))
    assert tok["pre_tokenizer"]["type"] == tok["decoder"]["type"] == "ByteLevel"
    assert tok["model"]["type"] == "BPE" and tok["model"]["merges"] == []
    b2u = bytes_to_unicode()
    assert tok["model"]["vocab"] == {b2u[b]: b for b in range(256)}
    assert [(a["id"], a["content"], a["special"]) for a in tok["added_tokens"]] == [
        (256, "<|endoftext|>", True)]
    text = "Grüße, 世界!\n\t\x00".encode()
    ids = [tok["model"]["vocab"][b2u[b]] for b in text]
    inv = {v: k for k, v in tok["model"]["vocab"].items()}
    u2b = {c: b for b, c in b2u.items()}
    assert bytes(u2b[inv[i]] for i in ids) == text and ids == list(text)

    # --step, bf16, and --dir with no coordinator give the same tensors.
    want20 = expected_tensors(read_params(epochs[20]))
    zctl(coord.grpc, "export", str(jid), "--step", "20", "--out", str(tmp_path / "s20"))
    check_tensors(str(tmp_path / "s20" / "model.safetensors"), want20)
    zctl(coord.grpc, "export", str(jid), "--step", "20", "--out", str(tmp_path / "bf"),
         "--dtype", "bf16")
    check_tensors(str(tmp_path / "bf" / "model.safetensors"), want20, "BF16")
    assert json.load(open(tmp_path / "bf" / "config.json"))["torch_dtype"] == "bfloat16"
    r = subprocess.run([os.path.join(BIN, "zctl"), "--coordinator", "127.0.0.1:1", "export",
                        "--dir", epochs[20], "--out", str(tmp_path / "nocoord")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    check_tensors(str(tmp_path / "nocoord" / "model.safetensors"), want20)
    usage = subprocess.run([os.path.join(BIN, "zctl")], capture_output=True, text=True, timeout=30)
    assert usage.returncode == 2 and "--dir CHECKPOINT_DIR" in usage.stderr

    # Errors name the problem, exit 1, and write nothing.
    def fails(*args, expect):
        r = zctl(coord.grpc, "export", *args, check=False)
        assert r.returncode == 1 and expect in r.stderr and len(r.stderr.splitlines()) == 1, r
    fails(str(jid), "--step", "7", "--out", str(tmp_path / "x"),
          expect="no committed checkpoint at step 7")
    assert not (tmp_path / "x").exists()
    (tmp_path / "afile").write_text("not a directory")
    fails(str(jid), "--out", str(tmp_path / "afile" / "out"), expect="afile")
    fails(str(jid), "--out", str(out), expect="exists and is not empty")
    assert sorted(os.listdir(out))[1] == "model.safetensors"
    nock = submit(coord, tiny_spec(train, val, 3, workers=1), tmp_path, "nock.json")
    wait_job(coord, nock)
    fails(str(nock), "--out", str(tmp_path / "y"), expect=f"job {nock} has no committed checkpoint")
    assert not glob.glob(str(tmp_path / "**" / "*.tmp-*"), recursive=True)


def hf_gpt2_loss(model_dir, samples):
    """Mean next-token loss of GPT2LMHeadModel as Hugging Face defines it, built from
    config.json and model.safetensors by tensor name: Conv1D y = x W + b with W [in, out],
    pre-LN blocks, gelu_new, attention scaled by 1/sqrt(head size), causal, the LM head tied
    to wte. Plain Python in double precision (no torch needed)."""
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    header, data = parse_safetensors(os.path.join(model_dir, "model.safetensors"))
    W = {}
    for name, h in header.items():
        b, e = h["data_offsets"]
        vals = list(array("f", data[b:e]))
        if len(h["shape"]) == 2:
            rows, cols = h["shape"]
            vals = [vals[r * cols:(r + 1) * cols] for r in range(rows)]
        W[name] = vals
    C, H, eps = cfg["n_embd"], cfg["n_head"], cfg["layer_norm_epsilon"]
    assert cfg["activation_function"] == "gelu_new" and cfg["tie_word_embeddings"]
    hs = C // H

    def ln(x, w, b):
        m = sum(x) / len(x)
        v = sum((a - m) ** 2 for a in x) / len(x)
        r = 1 / math.sqrt(v + eps)
        return [(a - m) * r * g + c for a, g, c in zip(x, w, b)]

    def conv1d(x, w, b):  # x [in], w [in][out]
        out = list(b)
        for xi, row in zip(x, w):
            for j, wij in enumerate(row):
                out[j] += xi * wij
        return out

    def gelu(a):
        return 0.5 * a * (1 + math.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))

    total, count = 0.0, 0
    for toks in samples:
        inp, tgt = toks[:-1], toks[1:]
        x = [[e + p for e, p in zip(W["transformer.wte.weight"][t], W["transformer.wpe.weight"][i])]
             for i, t in enumerate(inp)]
        for l in range(cfg["n_layer"]):
            P = f"transformer.h.{l}."
            h1 = [ln(r, W[P + "ln_1.weight"], W[P + "ln_1.bias"]) for r in x]
            qkv = [conv1d(r, W[P + "attn.c_attn.weight"], W[P + "attn.c_attn.bias"]) for r in h1]
            att = []
            for i in range(len(x)):
                row = []
                for h in range(H):
                    q = qkv[i][h * hs:(h + 1) * hs]
                    sc = [sum(a * b for a, b in zip(q, qkv[j][C + h * hs:C + (h + 1) * hs]))
                          / math.sqrt(hs) for j in range(i + 1)]
                    mx = max(sc)
                    ex = [math.exp(v - mx) for v in sc]
                    z = sum(ex)
                    row += [sum(ex[j] / z * qkv[j][2 * C + h * hs + d] for j in range(i + 1))
                            for d in range(hs)]
                att.append(row)
            x = [[a + b for a, b in zip(r, conv1d(o, W[P + "attn.c_proj.weight"],
                                                   W[P + "attn.c_proj.bias"]))]
                 for r, o in zip(x, att)]
            h2 = [ln(r, W[P + "ln_2.weight"], W[P + "ln_2.bias"]) for r in x]
            x = [[a + b for a, b in zip(r, conv1d(
                [gelu(v) for v in conv1d(o, W[P + "mlp.c_fc.weight"], W[P + "mlp.c_fc.bias"])],
                W[P + "mlp.c_proj.weight"], W[P + "mlp.c_proj.bias"]))] for r, o in zip(x, h2)]
        for r, t in zip(x, tgt):
            f = ln(r, W["transformer.ln_f.weight"], W["transformer.ln_f.bias"])
            logits = [sum(a * b for a, b in zip(f, e)) for e in W["transformer.wte.weight"]]
            mx = max(logits)
            total += mx + math.log(sum(math.exp(v - mx) for v in logits)) - logits[t]
            count += 1
    return total / count


def shard_samples(path, n, T):
    raw = open(path, "rb").read()
    toks = array("H", raw[1024:])
    return [list(toks[k * T:k * T + T + 1]) for k in range(n)]


def frozen(spec, **eval_kw):
    """The spec with learning rate 0 (the weights stay what they were loaded
    as) and a validation loss every step."""
    spec["optimizer"]["params"]["lr"] = 0.0
    spec["scheduler"]["params"].update(warmup_min_lr=0.0, warmup_max_lr=0.0)
    spec["eval"] = {"every_steps": 1, "batches": 4}
    return spec


def val_losses(coord, jid):
    from ztest import http_get
    steps = http_get(coord.http_port, f"/v1/jobs/{jid}/metrics")[2]["steps"]
    return {s["step"]: s["val_loss"] for s in steps}


def test_import_exported_weights(procs, tmp_path):
    """export -> init.from_safetensors -> the loss of the imported weights
    equals the loss of the epoch they were exported from (fp32: exactly);
    a model of another shape is refused naming the tensor."""
    train, val = byte_dataset(str(tmp_path / "data"), 200_000)
    coord = start_fleet(procs, 2, timeout_ms=None)
    a = tiny_spec(train, val, 30, stage=2, workers=2,
                  checkpoint={"dir": str(tmp_path / "ck"), "every_steps": 10})
    ja = submit(coord, a, tmp_path, "a.json")
    wait_job(coord, ja)
    epoch = [c for c in zctl_json(coord.grpc, "checkpoints", str(ja))["checkpoints"]
             if c["step"] == 20][0]["dir"]
    zctl_json(coord.grpc, "export", str(ja), "--step", "20", "--out", str(tmp_path / "hf"))
    model = str(tmp_path / "hf" / "model.safetensors")

    # The same weights, once imported and once resumed from the epoch.
    b = frozen(tiny_spec(train, val, 1, stage=3, workers=2, init={"from_safetensors": model}))
    jb = submit(coord, b, tmp_path, "b.json")
    c = frozen(tiny_spec(train, val, 21, stage=3, workers=2,
                         checkpoint={"dir": str(tmp_path / "ck2"), "load": epoch}))
    jc = submit(coord, c, tmp_path, "c.json")
    wait_job(coord, jb)
    wait_job(coord, jc)
    vb, vc = val_losses(coord, jb), val_losses(coord, jc)
    assert vb[1] == vc[21], (vb, vc)
    # The exported directory, loaded as Hugging Face defines GPT-2, gives the same loss on the
    # validation batches (eval.batches 4 x micro batch 2: the first 8 samples, docs/engine.md).
    ref = hf_gpt2_loss(str(tmp_path / "hf"), shard_samples(glob.glob(val)[0], 8, T))
    assert abs(ref - vb[1]) <= 1e-6 * ref, (ref, vb[1])
    # ... and not what a random initialisation gives.
    r = frozen(tiny_spec(train, val, 1, stage=3, workers=2))
    jr = submit(coord, r, tmp_path, "r.json")
    wait_job(coord, jr)
    assert val_losses(coord, jr)[1] > vb[1] + 0.5

    d = tiny_spec(train, val, 5, workers=1, init={"from_safetensors": model})
    d["model"]["n_embd"] = 64
    jd = submit(coord, d, tmp_path, "d.json")
    j = wait_job(coord, jd, states=("failed",))
    assert "transformer.wte.weight has shape [257, 32], the model needs [257, 64]" in j["message"], j


def test_export_gpt2_tokenizer(tmp_path):
    """Shards made with GPT-2's BPE: the epoch's manifest names zprep's record, and the export
    carries the encoder and merges the shards were made with as vocab.json and merges.txt,
    with the end-of-text id as bos/eos."""
    from test_engine_zprep import fortune_text, learn_bpe
    encoder, merges = learn_bpe(fortune_text("fortunes", 30000), 100)
    (tmp_path / "encoder.json").write_text(json.dumps(encoder, ensure_ascii=False))
    with open(tmp_path / "vocab.bpe", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    (tmp_path / "in.txt").write_text(fortune_text("fortunes", 120000), encoding="utf-8")
    subprocess.run([os.path.join(BIN, "zprep"), str(tmp_path / "in.txt"), "-o",
                    str(tmp_path / "d"), "--tokenizer", "gpt2", "--encoder",
                    str(tmp_path / "encoder.json"), "--bpe", str(tmp_path / "vocab.bpe"),
                    "--val-fraction", "0", "--prefix", "g"], check=True, capture_output=True)
    spec = tiny_spec(str(tmp_path / "d" / "g_train_*.bin"), "", 3, workers=1,
                     checkpoint={"dir": str(tmp_path / "ck"), "every_steps": 100})
    spec["model"]["vocab_size"] = len(encoder)
    del spec["data"]["val"]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    subprocess.run([os.path.join(BIN, "zsolo"), str(tmp_path / "spec.json")], check=True,
                   capture_output=True, timeout=120)
    manifests = glob.glob(str(tmp_path / "ck" / "**" / "manifest.json"), recursive=True)
    (epoch,) = [os.path.dirname(p) for p in manifests]
    man = json.load(open(os.path.join(epoch, "manifest.json")))
    assert man["step"] == 3
    assert man["tokenizer"] == os.path.realpath(tmp_path / "d" / "g_tokenizer.json")
    out = tmp_path / "hf"
    r = subprocess.run([os.path.join(BIN, "zctl"), "--json", "export", "--dir", epoch, "--out",
                        str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokenizer"] == "gpt2"
    assert sorted(os.listdir(out)) == ["config.json", "merges.txt", "model.safetensors",
                                       "special_tokens_map.json", "tokenizer_config.json",
                                       "vocab.json"]
    assert (out / "vocab.json").read_bytes() == (tmp_path / "encoder.json").read_bytes()
    assert (out / "merges.txt").read_bytes() == (tmp_path / "vocab.bpe").read_bytes()
    cfg = json.load(open(out / "config.json"))
    eot = encoder["<|endoftext|>"]
    assert cfg["vocab_size"] == len(encoder) and cfg["bos_token_id"] == cfg["eos_token_id"] == eot
    tc = json.load(open(out / "tokenizer_config.json"))
    assert tc["tokenizer_class"] == "GPT2Tokenizer" and tc["eos_token"] == "<|endoftext|>"
    assert tc["model_max_length"] == T
