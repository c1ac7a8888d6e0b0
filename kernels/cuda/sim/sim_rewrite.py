#!/usr/bin/env python3
"""sim_rewrite.py: turns CUDA sources into C++ for the CPU stand-in.

    sim_rewrite.py IN.cu -o OUT.cpp [--drop-sync FUNC:N] [--replace OLD=>NEW]
    sim_rewrite.py --outdir DIR IN... [--drop-sync FUNC:N] [--replace OLD=>NEW]

The stand-in (kernels/cuda/sim/, docs/gpu.md "The CPU stand-in") compiles
the CUDA sources a second time with g++ against its own <cuda_runtime.h>,
<cublasLt.h> and CUB header. Three things in a .cu file are not C++; this
script rewrites them in a generated copy (never checked in), keeping every
line where it was (a `#line` directive names the original file, so compiler
messages, gdb and backtraces point into the source).

With --outdir it rewrites a set of files that belong together, such as the
kernel table's (kernels/cuda/*.cu and their private header common.cuh):
each IN goes to DIR under its own name, a .cu file as .cpp. A rewritten
file that includes "common.cuh" then finds the rewritten header first (it
lies in the same folder). The set is analysed as one (item 3 below sees
the device functions and macros of every file), and each mutation must
apply exactly once in the whole set.

  1. Launches. `kern<<<grid, block[, shmem[, stream]]>>>(args)` becomes
     `zt_sim_launch(ZT_SIM_NAME(kern), kern, grid, block, shmem, stream,
     args)`; inside a macro (ZT_LAUNCH_1D) `kern` is the macro's parameter
     and ZT_SIM_NAME stringifies what it expands to.
  2. Shared memory. `__shared__ T name[N];` becomes
     `ZT_SIM_SHARED(T, name, [N]);`, a reference into the running block's
     shared area, keyed by a static of the declaring function (one per
     template instance); `extern __shared__ T name[];` becomes a pointer to
     the launch's dynamic shared memory.
  3. Which kernels need fibers. A kernel that (through the device functions
     and macros of the files it calls) uses __syncthreads, a warp shuffle, a
     vote or a warp matrix instruction (zt_ptx_*) is registered by
     name at the end of the copy that defines it: only those run
     each thread on its own fiber. The others run thread after thread on the
     scheduler's stack (much faster, same semantics for code with no
     barrier); if one of them reaches a barrier after all, the stand-in
     stops with an error naming it, so a wrong guess cannot pass silently.

Mutations, for the test that shows the stand-in catches bugs:
  --drop-sync FUNC:N    removes the N-th (1-based) `__syncthreads();` of
                        function FUNC (e.g. block_reduce:1)
  --replace OLD=>NEW    replaces the text OLD, which must occur exactly once
                        (in one file of the set)
Each mutation must apply, or the script fails.
"""
import argparse
import os
import re
import sys

SYNC_PRIMS = re.compile(
    r"\b(__syncthreads\w*|__syncwarp|__shfl\w*_sync|__ballot_sync|__any_sync|__all_sync|"
    r"__activemask|__match_\w+_sync|__reduce_\w+_sync|zt_ptx_\w+)\b")
IDENT = re.compile(r"[A-Za-z_]\w*")
LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)")


def fail(msg):
    sys.stderr.write("sim_rewrite: " + msg + "\n")
    sys.exit(1)


def mask_code(src):
    """src with comments and string/char literals blanked (same length,
    newlines kept), so that searches only see code."""
    out = list(src)
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if src[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c:
                j += 2 if src[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                if src[k] != "\n":
                    out[k] = " "
            i = j + 1
        else:
            i += 1
    return "".join(out)


def match_close(text, i, open_c, close_c):
    """Index just past the bracket that closes the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_c:
            depth += 1
        elif text[j] == close_c:
            depth -= 1
            if depth == 0:
                return j + 1
    fail(f"unbalanced {open_c}{close_c} at offset {i}")


def split_top(text):
    """Splits at commas outside (), [], {}."""
    parts, depth, cur = [], 0, ""
    for c in text:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += c
    parts.append(cur)
    return [p.strip() for p in parts]


def keep_lines(old, new):
    """new, padded with the newlines old had, so that lines stay put."""
    return new + "\n" * (old.count("\n") - new.count("\n"))


class Rewriter:
    def __init__(self, src):
        self.src = src
        self.edits = []  # (start, end, text)

    def edit(self, a, b, text):
        self.edits.append((a, b, keep_lines(self.src[a:b], text)))

    def apply(self):
        out, pos = [], 0
        for a, b, t in sorted(self.edits):
            if a < pos:
                fail(f"overlapping rewrites at offset {a}")
            out.append(self.src[pos:a])
            out.append(t)
            pos = b
        out.append(self.src[pos:])
        return "".join(out)


def functions(code):
    """(name, kind, body_start, body_end) of __global__/__device__ function
    definitions; kind is 'global' or 'device'."""
    found = []
    for m in re.finditer(r"\b(__global__|__device__)\b", code):
        # The declaration runs to the first '{' or ';' at paren depth 0.
        i, depth = m.end(), 0
        while i < len(code):
            c = code[i]
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
            elif depth == 0 and c in "{;":
                break
            i += 1
        if i >= len(code) or code[i] == ";":
            continue  # a declaration, or a __device__ variable
        head = LAUNCH_BOUNDS.sub("", code[m.end():i])
        p = head.find("(")
        if p < 0:
            continue
        names = IDENT.findall(head[:p])
        if not names:
            continue
        kind = "global" if m.group(1) == "__global__" else "device"
        if any(f[2] == i for f in found):
            continue  # "__device__ __forceinline__ ..." seen once
        found.append((names[-1], kind, i, match_close(code, i, "{", "}")))
    return found


def macros(code):
    """(name, body_start, body_end) of #define directives (continuations
    included)."""
    out = []
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)", code, re.M):
        j = m.end()
        while True:
            e = code.find("\n", j)
            e = len(code) if e < 0 else e
            if code[j:e].rstrip().endswith("\\") and e < len(code):
                j = e + 1
                continue
            break
        out.append((m.group(1), m.end(), e))
    return out


def sync_kernels(codes):
    """Names of the __global__ functions (of all the masked sources in
    codes) that need fibers."""
    ents, kernels = {}, set()
    for code in codes:
        for name, kind, a, b in functions(code):
            ents.setdefault(name, []).append(code[a:b])
            if kind == "global":
                kernels.add(name)
        for name, a, b in macros(code):
            ents.setdefault(name, []).append(code[a:b])
    marked = {n for n, bodies in ents.items() if any(SYNC_PRIMS.search(t) for t in bodies)}
    while True:
        more = {n for n, bodies in ents.items() if n not in marked
                and any(set(IDENT.findall(t)) & marked for t in bodies)}
        if not more:
            break
        marked |= more
    return kernels & marked


def rewrite_launches(code, rw):
    count = 0
    for m in re.finditer(r"<<<", code):
        a = m.start()
        # The kernel: an identifier, optionally with template arguments.
        k = a
        while k > 0 and code[k - 1] in " \t":
            k -= 1
        if code[k - 1] == ">":
            depth = 0
            j = k - 1
            while j >= 0:
                if code[j] == ">":
                    depth += 1
                elif code[j] == "<":
                    depth -= 1
                    if depth == 0:
                        break
                j -= 1
            k = j
        s = k
        while s > 0 and (code[s - 1].isalnum() or code[s - 1] in "_:"):
            s -= 1
        kernel = code[s:a].strip()
        if not IDENT.match(kernel):
            fail(f"cannot find the kernel before <<< at line {code.count(chr(10), 0, a) + 1}")
        e = code.find(">>>", a)
        if e < 0:
            fail("<<< without >>>")
        cfg = split_top(code[a + 3:e])
        if not 2 <= len(cfg) <= 4:
            fail(f"launch of {kernel}: expected 2 to 4 launch parameters, got {len(cfg)}")
        cfg += ["0"] * (4 - len(cfg))
        p = e + 3
        while code[p] in " \t\r\n\\":
            p += 1
        if code[p] != "(":
            fail(f"launch of {kernel}: expected ( after >>>")
        q = match_close(code, p, "(", ")")
        args = rw.src[p + 1:q - 1]
        text = (f"zt_sim_launch(ZT_SIM_NAME({kernel}), {kernel}, " + ", ".join(cfg)
                + (", " + args if args.strip() else "") + ")")
        old = rw.src[s:q]
        if "\\\n" in old:
            # Inside a macro: one physical line, the continuations after it.
            text = text.replace("\\\n", " ")
            rw.edits.append((s, q, text + "\\\n" * old.count("\n")))
        else:
            rw.edit(s, q, text)
        count += 1
    return count


def rewrite_shared(code, rw):
    decl = re.compile(
        r"(\bextern\s+)?\b__shared__\s+((?:[A-Za-z_][\w:<>]*\s+)*?[A-Za-z_][\w:<>]*)\s*"
        r"(\**)\s*([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*);")
    count = 0
    for d in decl.finditer(code):
        typ = (d.group(2) + " " + d.group(3)).strip()
        name, dims = d.group(4), d.group(5).replace(" ", "")
        if d.group(1):
            text = f"{typ} *{name} = ZT_SIM_DYNAMIC_SHARED({typ});"
        else:
            text = f"ZT_SIM_SHARED({typ}, {name}, {dims});"
        rw.edit(d.start(), d.end(), text)
        count += 1
    total = len(re.findall(r"\b__shared__\b", code))
    if count != total:
        fail(f"{total - count} __shared__ declaration(s) not of the form "
             "`[extern] __shared__ T name[N]...;` (one declarator each)")
    return count


def drop_sync(code, rw, spec):
    """Applies --drop-sync to one file: True when FUNC is defined there."""
    fname, _, nth = spec.partition(":")
    try:
        nth = int(nth)
    except ValueError:
        fail(f"--drop-sync {spec}: expected FUNC:N")
    for name, _, a, b in functions(code):
        if name != fname:
            continue
        hits = [m for m in re.finditer(r"__syncthreads\s*\(\s*\)\s*;", code[a:b])]
        if nth < 1 or nth > len(hits):
            fail(f"--drop-sync {spec}: {fname} has {len(hits)} __syncthreads()")
        h = hits[nth - 1]
        rw.edit(a + h.start(), a + h.end(), "/* zt-sim mutation: __syncthreads() removed */")
        return True
    return False


def c_string(path):
    return path.replace("\\", "\\\\").replace('"', '\\"')


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+")
    out = ap.add_mutually_exclusive_group(required=True)
    out.add_argument("-o", "--output")
    out.add_argument("--outdir")
    ap.add_argument("--drop-sync", action="append", default=[])
    ap.add_argument("--replace", action="append", default=[])
    a = ap.parse_args()
    if a.output and len(a.inputs) != 1:
        fail("-o takes one input (--outdir takes several)")
    srcs = []
    for path in a.inputs:
        with open(path, encoding="utf-8") as f:
            srcs.append(f.read())
    for r in a.replace:
        old, sep, new = r.partition("=>")
        counts = [src.count(old) for src in srcs] if sep else []
        if not sep or sum(counts) != 1:
            fail(f"--replace {r!r}: the text must occur exactly once "
                 f"(found {sum(counts) if sep else 'no =>'})")
        i = counts.index(1)
        srcs[i] = srcs[i].replace(old, new)
    codes = [mask_code(src) for src in srcs]
    rws = [Rewriter(src) for src in srcs]
    for spec in a.drop_sync:
        applied = [drop_sync(code, rw, spec) for code, rw in zip(codes, rws)]
        if sum(applied) != 1:
            fail(f"--drop-sync {spec}: {spec.partition(':')[0]} is defined in "
                 f"{sum(applied)} of the files, not one")
    fibers = sync_kernels(codes)
    launches = [rewrite_launches(code, rw) for code, rw in zip(codes, rws)]
    shared = [rewrite_shared(code, rw) for code, rw in zip(codes, rws)]
    if sum(launches) == 0:
        fail("no kernel launch found: are these the right files?")
    mutated = " (mutated)" if a.drop_sync or a.replace else ""
    for i, path in enumerate(a.inputs):
        if a.output:
            dest = a.output
        else:
            base = os.path.basename(path)
            if base.endswith(".cu"):
                base = base[:-3] + ".cpp"
            dest = os.path.join(a.outdir, base)
        text = rws[i].apply()
        if not text.endswith("\n"):
            text += "\n"
        # The kernels of this file that need fibers (registered at its end).
        own = sorted({n for n, kind, _, _ in functions(codes[i]) if kind == "global"} & fibers)
        os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
        with open(dest, "w", encoding="utf-8") as f:
            f.write(f"/* Generated by kernels/cuda/sim/sim_rewrite.py from {path}{mutated}:\n"
                    f" * {launches[i]} launches, {shared[i]} __shared__ declarations rewritten.\n"
                    " * Do not edit; do not check in. */\n"
                    "#include \"zt_sim.h\"\n"
                    f"#line 1 \"{c_string(path)}\"\n")
            f.write(text)
            if not own:
                continue
            # The header above is 5 lines and `text` ends with a newline: the
            # line after this directive is line count + 7 of the output.
            f.write(f'#line {text.count(chr(10)) + 7} "{c_string(dest)}"\n')
            f.write("\n/* Kernels that run each thread on a fiber (they reach barriers, shuffles or\n"
                    " * votes, directly or through the functions and macros they use). */\n")
            names = ", ".join(f'"{k}"' for k in own)
            f.write(f"static const zt_sim::fiber_kernels zt_sim_fiber_kernels_{{{{{names}}}}};\n")


if __name__ == "__main__":
    main()
