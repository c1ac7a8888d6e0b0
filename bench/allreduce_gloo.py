#!/usr/bin/env python3
"""bench/allreduce_gloo.py: Gloo's all-reduce (torch.distributed, backend
"gloo") on loopback, measured the way zt_commrun measures ours, for
bench/allreduce.

Starts N processes on 127.0.0.1 (init_method tcp://, GLOO_SOCKET_IFNAME=lo).
For each size, every rank runs WARMUP + ITERS all_reduce(SUM) calls of a
float32 tensor of that many bytes (values i % 7, like zt_commrun), timing
each call on its own; rank 0 prints one JSON line per size, in zt_commrun's
format: {"op":"all_reduce","world":N,"bytes":..,"avg_ms":..,"algbw_GBps":..,
"busbw_GBps":..}, busbw = 2(N-1)/N x bytes / avg time.

usage: allreduce_gloo.py --world N [--sizes 1M,16M,64M] [--iters K] [--warmup W]
Exits 77 when torch (python3-torch) is not importable.
"""
import argparse
import json
import os
import socket
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--world", type=int, required=True)
ap.add_argument("--sizes", default="1M,16M,64M")
ap.add_argument("--iters", type=int, default=10)
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
args = ap.parse_args()

try:
    import torch
    import torch.distributed as dist
except ImportError as e:
    print(f"torch is not importable: {e}", file=sys.stderr)
    sys.exit(77)


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def rank_main(rank, world, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    for s in args.sizes.split(","):
        nbytes = parse_size(s)
        n = nbytes // 4
        buf = (torch.arange(n, dtype=torch.int64) % 7).to(torch.float32)
        total = 0.0
        for it in range(args.warmup + args.iters):
            t0 = time.perf_counter()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            dt = time.perf_counter() - t0
            if it >= args.warmup:
                total += dt
        avg = total / args.iters
        algbw = nbytes / avg / 1e9
        if rank == 0:
            print(json.dumps({"op": "all_reduce", "world": world, "bytes": nbytes,
                              "avg_ms": round(avg * 1e3, 3), "algbw_GBps": round(algbw, 3),
                              "busbw_GBps": round(algbw * 2 * (world - 1) / world, 3)}),
                  flush=True)
    dist.destroy_process_group()


if args.rank >= 0:
    rank_main(args.rank, args.world, args.port)
    sys.exit(0)

import subprocess

s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()
env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
base = [sys.executable, os.path.abspath(__file__), "--world", str(args.world), "--sizes",
        args.sizes, "--iters", str(args.iters), "--warmup", str(args.warmup), "--port", str(port)]
procs = [subprocess.Popen(base + ["--rank", str(r)], env=env,
                          stdout=None if r == 0 else subprocess.DEVNULL)
         for r in range(args.world)]
rc = max(p.wait() for p in procs)
sys.exit(rc)
