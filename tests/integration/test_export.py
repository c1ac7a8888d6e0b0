"""zctl export: a committed epoch as a Hugging Face GPT-2 safetensors file.

The file is parsed here independently (8-byte header length, JSON header,
dtypes, shapes, contiguous offsets) and every tensor is compared with the
parameters read straight from the epoch's rank files (their own JSON index,
not our C reader), transposing the Conv1D weights.
"""
import glob
import json
import os
import struct
from array import array

from ztest import byte_dataset, start_fleet, submit, tiny_spec, wait_job, zctl, zctl_json

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


def test_export_safetensors(procs, tmp_path):
    train, val = byte_dataset(str(tmp_path / "data"), 200_000)
    coord = start_fleet(procs, 2, timeout_ms=None)
    spec = tiny_spec(train, val, 30, stage=3, workers=2,
                     checkpoint={"dir": str(tmp_path / "ck"), "every_steps": 20})
    jid = submit(coord, spec, tmp_path)
    wait_job(coord, jid)
    epoch = [c for c in zctl_json(coord.grpc, "checkpoints", str(jid))["checkpoints"]
             if c["step"] == 20][0]["dir"]
    want = expected_tensors(read_params(epoch))

    f32 = str(tmp_path / "model.safetensors")
    r = zctl_json(coord.grpc, "export", str(jid), "--step", "20", "--out", f32)
    assert r["bytes"] == os.path.getsize(f32)
    header, data = parse_safetensors(f32)
    assert set(header) == set(want), set(header) ^ set(want)
    for name, (shape, vals) in want.items():
        h = header[name]
        assert h["dtype"] == "F32" and h["shape"] == shape, (name, h, shape)
        b, e = h["data_offsets"]
        got = array("f", data[b:e])
        assert list(got) == [array("f", [v])[0] for v in vals], name

    bf = str(tmp_path / "model-bf16.safetensors")
    zctl(coord.grpc, "export", str(jid), "--step", "20", "--out", bf, "--dtype", "bf16")
    header, data = parse_safetensors(bf)
    for name, (shape, vals) in want.items():
        h = header[name]
        assert h["dtype"] == "BF16" and h["shape"] == shape
        b, e = h["data_offsets"]
        got = array("H", data[b:e])
        for g, v in zip(got, vals):
            assert abs(bf16_to_f32(g) - v) <= abs(v) * 2 ** -8 + 1e-30, (name, g, v)

    # Errors name the problem.
    r = zctl(coord.grpc, "export", str(jid), "--step", "7", "--out", f32, check=False)
    assert r.returncode == 1 and "no committed checkpoint at step 7" in r.stderr


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
    model = str(tmp_path / "data" / "model.safetensors")
    zctl_json(coord.grpc, "export", str(ja), "--step", "20", "--out", model)

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
