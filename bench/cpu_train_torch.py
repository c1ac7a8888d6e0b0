#!/usr/bin/env python3
"""bench/cpu_train_torch.py: the PyTorch (CPU, fp32, eager) twin of one
bench/cpu-train run, so the two can be compared on the same machine.

Trains the model the ztrain engine trains for a spec (GPT-2: token +
position embeddings, pre-LN blocks, causal attention, GELU-tanh MLP of
width 4C, final LayerNorm, LM head tied to wte; no dropout; or, with
model.arch "llama", Hugging Face's Llama: RMSNorm, q/k/v in one matmul as
the engine does, rotary positions (rotate_half), grouped-query attention
with K/V heads repeated as Hugging Face's repeat_kv does, SwiGLU with gate
and up in one matmul, tied head) with the spec's
micro batch, AdamW (decay on 2-D weights only, like engine/optim.c),
gradient clipping and WarmupDecayLR schedule (linear warm-up, cosine decay),
on the spec's token shards (llm.c format, windows of T + 1 tokens, shuffled
with numpy's generator, not ztrain's order: only the timing is compared).

The vocabulary is padded like the engine's (to the next multiple of 64,
257 -> 320): the LM head is one [B T, C] x [C, Vp] matmul and the padded
logits are dropped before the cross-entropy, the same work the engine does.

Prints one JSON line: threads, interop, steps, ms (median ms/step over the
steps after the first, like bench/cpu-train's figures for ztrain),
tokens_per_s (B T / median time), loss_first, loss_last, and blas_core:
the kernel family OpenBLAS (PyTorch's BLAS in Debian's build) picked in
this process (openblas_get_corename; "not OpenBLAS" with another BLAS).
bench/cpu-train runs this script with OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE removed from its environment, so that OpenBLAS picks the
kernels made for this CPU rather than the ones a setting forces.

usage: cpu_train_torch.py SPEC --threads N [--interop K] [--attn manual|sdpa]
                          [--foreach 0|1]

--foreach 1 (bench/cpu-train's choice) is PyTorch's multi-tensor AdamW, the
faster of its two CPU implementations here (1.13 has no fused CPU AdamW);
--attn sdpa uses 1.13's private F._scaled_dot_product_attention, which
measured the same as the explicit attention on CPU.
Set OPENBLAS_NUM_THREADS to N in the environment (bench/cpu-train does):
PyTorch's matmuls run in OpenBLAS's own thread pool, which
torch.set_num_threads does not size.
"""
import argparse
import glob
import json
import math
import statistics
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("spec")
ap.add_argument("--threads", type=int, required=True)
ap.add_argument("--interop", type=int, default=0, help="0: PyTorch's default")
ap.add_argument("--attn", choices=("manual", "sdpa"), default="manual")
ap.add_argument("--foreach", type=int, default=0)
args = ap.parse_args()

try:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
    sys.exit(77)

# Thread settings first: interop threads can only be set before any
# parallel work has started.
if args.interop:
    torch.set_num_interop_threads(args.interop)
torch.set_num_threads(args.threads)

spec = json.load(open(args.spec))
m = spec["model"]
L, NH, C, T, V = m["n_layer"], m["n_head"], m["n_embd"], m["seq_len"], m["vocab_size"]
VP = (V + 63) // 64 * 64
B = spec["train_micro_batch_size_per_gpu"]
STEPS = spec["steps"]
opt_p = spec["optimizer"]["params"]
sched = spec.get("scheduler", {}).get("params")
clip = spec.get("gradient_clipping", 0.0)


def lr_at(s):
    if not sched:
        return opt_p["lr"]
    lo, hi = sched["warmup_min_lr"], sched["warmup_max_lr"]
    W, S = sched["warmup_num_steps"], sched["total_num_steps"]
    if s < W:
        return lo + (hi - lo) * (s + 1) / W
    if s < S:
        return lo + (hi - lo) * (1 + math.cos(math.pi * (s - W) / (S - W))) / 2
    return lo


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).triu(1), persistent=False)

    def attn(self, x):
        B_, T_, _ = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B_, T_, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        if args.attn == "sdpa":  # PyTorch 1.13's private fused entry (math path on CPU)
            y = F._scaled_dot_product_attention(q, k, v, is_causal=True)[0]
        else:  # nanoGPT's explicit attention
            a = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // NH))
            a = a.masked_fill(self.mask[:T_, :T_], float("-inf")).softmax(dim=-1)
            y = a @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B_, T_, C))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class LlamaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.HD, self.KV, FF = m["head_dim"], m["n_kv_head"], m["intermediate_size"]
        self.FF = FF
        self.rms_1, self.rms_2 = nn.Parameter(torch.ones(C)), nn.Parameter(torch.ones(C))
        self.qkv = nn.Linear(C, (NH + 2 * self.KV) * self.HD, bias=False)
        self.o_proj = nn.Linear(NH * self.HD, C, bias=False)
        self.gate_up = nn.Linear(C, 2 * FF, bias=False)
        self.down = nn.Linear(FF, C, bias=False)
        self.register_buffer("mask", torch.ones(T, T, dtype=torch.bool).triu(1), persistent=False)
        inv = 1.0 / (m.get("rope_theta", 10000.0) ** (torch.arange(0, self.HD, 2).float() / self.HD))
        emb = torch.outer(torch.arange(T).float(), inv).repeat(1, 2)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.get("rms_norm_eps", 1e-6)))

    def rope(self, x, T_):
        h = self.HD // 2
        return x * self.cos[:T_] + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * self.sin[:T_]

    def attn(self, x):
        B_, T_, _ = x.shape
        HD, KV = self.HD, self.KV
        q, k, v = self.qkv(x).split([NH * HD, KV * HD, KV * HD], dim=2)
        q = self.rope(q.view(B_, T_, NH, HD).transpose(1, 2), T_)
        k = self.rope(k.view(B_, T_, KV, HD).transpose(1, 2), T_)
        v = v.view(B_, T_, KV, HD).transpose(1, 2)
        k, v = k.repeat_interleave(NH // KV, dim=1), v.repeat_interleave(NH // KV, dim=1)
        if args.attn == "sdpa":
            y = F._scaled_dot_product_attention(q, k, v, is_causal=True)[0]
        else:
            a = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HD))
            a = a.masked_fill(self.mask[:T_, :T_], float("-inf")).softmax(dim=-1)
            y = a @ v
        return self.o_proj(y.transpose(1, 2).contiguous().view(B_, T_, NH * HD))

    def forward(self, x):
        x = x + self.attn(self.rms(x, self.rms_1))
        g, u = self.gate_up(self.rms(x, self.rms_2)).split(self.FF, dim=2)
        return x + self.down(F.silu(g) * u)


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VP, C)
        self.h = nn.ModuleList(LlamaBlock() for _ in range(L))
        self.norm = nn.Parameter(torch.ones(C))
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
        with torch.no_grad():
            self.wte.weight[V:].zero_()

    def forward(self, idx, targets):
        x = self.wte(idx)
        for b in self.h:
            x = b(x)
        logits = F.linear(self.h[0].rms(x, self.norm), self.wte.weight)[..., :V]
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VP, C), nn.Embedding(T, C)
        self.h = nn.ModuleList(Block() for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith("c_proj.weight") or \
                    name.endswith("mlp_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif "ln" in name and name.endswith("weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)
        with torch.no_grad():
            self.wte.weight[V:].zero_()

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.h:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)[..., :V]
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def shards(pattern):
    toks = []
    for f in sorted(glob.glob(pattern)):
        hdr = np.fromfile(f, dtype="<i4", count=256)
        assert hdr[0] == 20240520 and hdr[1] in (1, 2), f
        toks.append(np.memmap(f, dtype="<u2" if hdr[1] == 1 else "<u4", mode="r", offset=1024,
                              shape=(int(hdr[2]),)))
    return np.concatenate(toks).astype(np.int64)


def blas_core():
    """The core OpenBLAS chose, read from the library this process loaded."""
    import ctypes
    with open("/proc/self/maps") as f:
        libs = {l.split()[-1] for l in f if "openblas" in l and ".so" in l}
    for lib in sorted(libs):
        try:
            fn = ctypes.CDLL(lib).openblas_get_corename
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_char_p
        return fn().decode()
    return "not OpenBLAS"


def main():
    torch.manual_seed(spec.get("seed", 1337))
    data = shards(spec["data"]["train"])
    n_samples = (len(data) - 1) // T
    order = np.random.default_rng(spec.get("seed", 1337)).permutation(n_samples)
    model = Llama() if m.get("arch") == "llama" else GPT()
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": opt_p["weight_decay"]},
                             {"params": other, "weight_decay": 0.0}],
                            lr=opt_p["lr"], betas=tuple(opt_p["betas"]), eps=opt_p["eps"],
                            foreach=bool(args.foreach))
    times, losses = [], []
    pos = 0
    for s in range(STEPS):
        rows = []
        for _ in range(B):
            k = int(order[pos % n_samples]) * T
            rows.append(data[k:k + T + 1])
            pos += 1
        batch = torch.from_numpy(np.stack(rows))
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        t0 = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(s)
        loss = model(x, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    ms = statistics.median(times[1:] if len(times) > 1 else times) * 1e3
    print(json.dumps({"threads": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
                      "attn": args.attn, "foreach": args.foreach, "steps": STEPS, "ms": ms,
                      "tokens_per_s": B * T / (ms / 1e3), "loss_first": losses[0],
                      "loss_last": losses[-1], "torch": torch.__version__,
                      "blas_core": blas_core()}))


main()
