"""ztest.py: helpers for ztrain's integration tests.

The tests drive real processes: zcoord with a real SQLite file, zworkers,
zctl, on 127.0.0.1. Every wait is a poll with a deadline (wait_until), never
a bare sleep. Processes are started through Procs, which kills whatever is
left at the end of a test and keeps each process's stderr in a log file that
is printed when a test fails.
"""
import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request

BIN = os.environ.get("ZT_BIN", os.path.join(os.path.dirname(__file__), "../../build/bin"))
SRC = os.environ.get("ZT_SRC", os.path.join(os.path.dirname(__file__), "../.."))
SANITIZE = os.environ.get("ZT_SANITIZE", "0") in ("1", "ON", "TRUE", "true")
# Sanitizer builds run several times slower; deadlines (not bounds under
# test) stretch by this factor.
SLOW = 4.0 if SANITIZE else 1.0


def wait_until(pred, timeout, what, interval=0.02):
    """Polls pred() until it returns a truthy value; fails after timeout s."""
    deadline = time.monotonic() + timeout * SLOW
    last_exc = None
    while True:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # the condition may not be observable yet
            last_exc = e
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout * SLOW:.1f}s waiting for {what}"
                                 + (f" (last error: {last_exc})" if last_exc else ""))
        time.sleep(interval)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_post_json(port, path, body, timeout=10, host="127.0.0.1"):
    """POSTs body as JSON; returns (status, parsed JSON reply)."""
    req = urllib.request.Request(f"http://{host}:{port}{path}", data=json.dumps(body).encode(),
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def http_get(port, path, timeout=5, host="127.0.0.1"):
    """Returns (status, content_type, parsed JSON or text)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout) as r:
            body, status, ctype = r.read(), r.status, r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        body, status, ctype = e.read(), e.code, e.headers.get("Content-Type", "")
    if ctype.startswith("application/json"):
        return status, ctype, json.loads(body)
    return status, ctype, body.decode(errors="replace")


class Proc:
    def __init__(self, name, argv, logdir, env=None):
        self.name = name
        self.argv = argv
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.log = open(self.log_path, "ab")
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                  env={**os.environ, **(env or {})})

    @property
    def pid(self):
        return self.p.pid

    def alive(self):
        return self.p.poll() is None

    def signal(self, sig):
        self.p.send_signal(sig)

    def wait(self, timeout):
        return self.p.wait(timeout=timeout * SLOW)

    def kill(self):
        if self.alive():
            self.p.kill()
            self.p.wait()

    def output(self):
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")


class Procs:
    """Starts and reaps processes for one test.

    Job data and checkpoints live in pytest's temporary directories, all
    under one base directory: that is the data and checkpoint root of every
    zcoord and zworker started here (the default root, the working
    directory, would refuse them)."""

    def __init__(self, tmpdir):
        self.tmp = str(tmpdir)
        self.root = os.path.dirname(os.path.realpath(self.tmp))
        self.all = []

    def start(self, name, argv, env=None):
        p = Proc(name, argv, self.tmp, env)
        self.all.append(p)
        return p

    def coord(self, db=None, hb_ms=200, timeout_ms=None, extra=(), name="zcoord", env=None,
              grpc_port=0, http_port=0, test_knobs=True):
        """Starts zcoord on free ports and waits until it serves."""
        db = db or os.path.join(self.tmp, "zcoord.db")
        ready = os.path.join(self.tmp, f"{name}.ready")
        if os.path.exists(ready):
            os.unlink(ready)
        argv = [f"{BIN}/zcoord", "--grpc", f"127.0.0.1:{grpc_port}",
                "--http", f"127.0.0.1:{http_port}", "--db", db,
                "--heartbeat-ms", str(hb_ms), "--ready-file", ready,
                "--data-root", self.root, "--checkpoint-root", self.root]
        if test_knobs:
            argv.append("--allow-test-knobs")
        if timeout_ms:
            argv += ["--heartbeat-timeout-ms", str(timeout_ms)]
        p = self.start(name, argv + list(extra), env)

        def is_ready():
            assert p.alive(), f"zcoord exited: {p.output()}"
            with open(ready) as f:
                return json.load(f)
        info = wait_until(is_ready, 10, "zcoord ready file")
        p.grpc_port, p.http_port, p.db = info["grpc_port"], info["http_port"], db
        p.grpc = f"127.0.0.1:{p.grpc_port}"
        return p

    def worker(self, coord_addr, name, extra=(), env=None, proc_name=None):
        """Starts a CPU zworker; proc_name (default name) names its log and
        work directory, so two processes may claim one worker name."""
        proc_name = proc_name or name
        wd = os.path.join(self.tmp, "work", proc_name)
        return self.start(proc_name, [f"{BIN}/zworker", "--coordinator", coord_addr, "--name", name,
                                 "--workdir", wd, "--device", "cpu", "--data-root", self.root,
                                 "--checkpoint-root", self.root] + list(extra), env)

    def close(self):
        for p in self.all:
            p.kill()
            p.log.close()

    def dump(self):
        out = []
        for p in self.all:
            out.append(f"----- {p.name} ({' '.join(p.argv)}) -----\n{p.output()[-6000:]}")
        return "\n".join(out)


def start_fleet(procs, n=None, names=None, extra=("--threads", "1"), prefix="w", hb_ms=300,
                timeout_ms=3000, wait_s=20, worker_env=None, env_by_name=None, coord=None,
                extra_by_name=None, **coord_kw):
    """Starts zworkers (the given names, or n named prefix0..) under a new
    zcoord (or `coord`) and waits until every one of them is alive. Returns
    zcoord; coord.workers maps each started worker's name to its Proc."""
    coord = coord or procs.coord(hb_ms=hb_ms, timeout_ms=timeout_ms, **coord_kw)
    names = list(names) if names else [f"{prefix}{i}" for i in range(n)]
    if not hasattr(coord, "workers"):
        coord.workers = {}
    for nm in names:
        env = {**(worker_env or {}), **(env_by_name or {}).get(nm, {})}
        more = list((extra_by_name or {}).get(nm, ()))
        coord.workers[nm] = procs.worker(coord.grpc, nm, extra=list(extra) + more, env=env)
    wait_until(lambda: all(workers_by_name(coord).get(nm, {}).get("state") == "alive"
                           for nm in names), wait_s, f"workers {names} alive")
    return coord


def zctl(coord_addr, *args, check=True):
    r = subprocess.run([f"{BIN}/zctl", "--coordinator", coord_addr, *args],
                       capture_output=True, text=True, timeout=30 * SLOW)
    if check and r.returncode != 0:
        raise AssertionError(f"zctl {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r


def zctl_json(coord_addr, *args):
    return json.loads(zctl(coord_addr, "--json", *args).stdout)


def workers_by_name(coord):
    return {w["name"]: w for w in http_get(coord.http_port, "/v1/workers")[2]["workers"]}


def events(coord, **q):
    qs = "&".join(f"{k}={v}" for k, v in q.items())
    return http_get(coord.http_port, "/v1/events" + (f"?{qs}" if qs else ""))[2]["events"]


# ---- training jobs ----------------------------------------------------------

# ZT_FORTUNES points elsewhere on a machine without the Debian package.
FORTUNES = os.environ.get("ZT_FORTUNES", "/usr/share/games/fortunes")


def english_text(limit=400_000):
    """Real English text: the fortunes corpus (a Debian package)."""
    import glob as _glob
    out = bytearray()
    for f in sorted(_glob.glob(FORTUNES + "/*")):
        if os.path.isdir(f) or f.endswith(".dat") or os.path.islink(f):
            continue
        with open(f, "rb") as fh:
            data = fh.read()
        if b"\0" in data[:200]:
            continue
        out += data
        if len(out) >= limit:
            break
    if len(out) < limit // 2:
        raise RuntimeError(f"english_text: only {len(out)} bytes of text under {FORTUNES} "
                           "(install fortunes-min/fortune-mod, or set ZT_FORTUNES)")
    return bytes(out[:limit])


def bytes_to_unicode():
    """GPT-2's byte -> printable character table (openai/gpt-2 encoder.py)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) +
          list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def write_shard(path, tokens):
    """llm.c token shard: 256 int32 header (magic, version, count), uint16
    tokens (version 1), or uint32 (version 2) when an id needs it."""
    import array
    wide = max(tokens, default=0) > 0xffff
    h = array.array("i", [0] * 256)
    h[0], h[1], h[2] = 20240520, 2 if wide else 1, len(tokens)
    with open(path, "wb") as f:
        f.write(h.tobytes())
        f.write(array.array("I" if wide else "H", tokens).tobytes())


def byte_dataset(dirpath, limit=400_000):
    """Byte-level shards (vocab 257, 256 = end of text) of real English."""
    os.makedirs(dirpath, exist_ok=True)
    toks = list(english_text(limit))
    n = len(toks)
    write_shard(os.path.join(dirpath, "val_000000.bin"), toks[: n // 10])
    write_shard(os.path.join(dirpath, "train_000000.bin"), toks[n // 10: n // 2])
    write_shard(os.path.join(dirpath, "train_000001.bin"), toks[n // 2:])
    return os.path.join(dirpath, "train_*.bin"), os.path.join(dirpath, "val_*.bin")


def tiny_spec(train, val, steps=50, stage=0, workers=1, max_workers=None, micro=2, gbs=24,
              **extra):
    spec = {
        "name": f"tiny-s{stage}-n{workers}", "seed": 7, "steps": steps,
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "seq_len": 32, "vocab_size": 257},
        "data": {"train": train, "val": val},
        "train_micro_batch_size_per_gpu": micro, "train_batch_size": gbs,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95],
                                                  "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                 "warmup_num_steps": min(10, steps - 1), "total_num_steps": steps}},
        "zero_optimization": {"stage": stage},
        "elastic": {"min_workers": workers, "max_workers": max_workers or workers},
        "comm": {"timeout_ms": 10000},
        # Exactness tests compare against a failure-free run; a rollback
        # (its own tests enable it) would change the data on purpose.
        "rollback": {"enabled": False},
    }
    for k, v in extra.items():
        spec[k] = v
    return spec


def submit(coord, spec, tmpdir, name="job.json"):
    path = os.path.join(str(tmpdir), name)
    with open(path, "w") as f:
        json.dump(spec, f)
    return int(zctl_json(coord.grpc, "submit", path)["job_id"])


def job(coord, jid):
    return http_get(coord.http_port, f"/v1/jobs/{jid}")[2]


def wait_job(coord, jid, timeout=120, states=("completed",)):
    def done():
        j = job(coord, jid)
        assert j["state"] not in ("failed", "canceled") or j["state"] in states, j
        return j if j["state"] in states else None
    return wait_until(done, timeout, f"job {jid} to reach {states}", interval=0.05)


def job_members(coord, jid, current_only=True):
    """Names of the workers in the job's current generation (or in any)."""
    import sqlite3
    join = " JOIN jobs j ON j.id = m.job_id AND j.generation = m.gen" if current_only else ""
    with sqlite3.connect(coord.db) as db:
        return {r[0] for r in db.execute(
            "SELECT DISTINCT w.name FROM members m JOIN workers w ON w.id = m.worker_id" + join +
            " WHERE m.job_id = ?", (jid,))}


BREAKDOWN = re.compile(r"step (\d+): ([\d.]+) ms; waited ([\d.]+) ms for gradient reductions, "
                       r"([\d.]+) ms for gathers; communication thread ([\d.]+) ms busy, "
                       r"([\d.]+) ms CPU")


def breakdown_rows(text):
    """The wall_clock_breakdown lines of a worker log: (step, ms, waited for reductions,
    waited for gathers, communication thread busy, its CPU) per line, in order."""
    return [(int(m[1]),) + tuple(float(x) for x in m.groups()[1:])
            for m in BREAKDOWN.finditer(text)]


def losses(coord, jid, val=False):
    """{step: loss}, or with val {step: (loss, validation loss or None)}."""
    steps = http_get(coord.http_port, f"/v1/jobs/{jid}/metrics")[2]["steps"]
    return {s["step"]: (s["loss"], s.get("val_loss")) if val else s["loss"] for s in steps}


# ---- pytest glue shared by the conftest files ---------------------------------

def closing_with_logs(request, thing):
    """Teardown of a fixture that owns processes: their logs are printed
    when the test failed, then they are stopped (thing: .dump(), .close())."""
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        print(thing.dump())
    thing.close()


def makereport_hook():
    """A pytest_runtest_makereport that keeps each phase's report on the
    item (item.rep_call), for closing_with_logs."""
    import pytest

    @pytest.hookimpl(tryfirst=True, hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        rep = outcome.get_result()
        setattr(item, "rep_" + rep.when, rep)
    return pytest_runtest_makereport


# ---- Hugging Face model directories -------------------------------------------

TINY_LLAMA = {"arch": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32,
              "intermediate_size": 64, "seq_len": 32, "vocab_size": 257}


def write_safetensors_np(path, tensors):
    """A safetensors file of F32 numpy arrays (name -> array), in order."""
    import numpy as np
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def hf_llama_config(m, **over):
    """config.json as Hugging Face writes it for the model section m (our
    field names) of a Llama without biases."""
    hd = m.get("head_dim", m["n_embd"] // m["n_head"])
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": m["n_embd"], "num_hidden_layers": m["n_layer"],
           "num_attention_heads": m["n_head"], "num_key_value_heads": m["n_kv_head"],
           "head_dim": hd, "intermediate_size": m["intermediate_size"],
           "vocab_size": m["vocab_size"], "rope_theta": m.get("rope_theta", 10000.0),
           "rms_norm_eps": m.get("rms_norm_eps", 1e-5),
           "tie_word_embeddings": m.get("tie_word_embeddings", True),
           "max_position_embeddings": m.get("max_position_embeddings", 128),
           "hidden_act": "silu", "attention_bias": False, "torch_dtype": "float32"}
    cfg.update(over)
    return cfg


def write_hf_llama(d, m=TINY_LLAMA, seed=3, **config):
    """A Hugging Face Llama directory (config.json, model.safetensors with
    random weights) for the model section m; config overrides fields of
    config.json. Returns the directory."""
    import numpy as np
    os.makedirs(d, exist_ok=True)
    cfg = hf_llama_config(m, **config)
    rng = np.random.default_rng(seed)
    C, hd, F, V = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]
    A, KV = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def rnd(*shape, std=0.1):
        return (rng.standard_normal(shape) * std).astype(np.float32)
    w = {"model.embed_tokens.weight": rnd(V, C, std=0.5), "model.norm.weight": 1 + rnd(C)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(V, C)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rnd(C)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(C)
        w[p + "self_attn.q_proj.weight"] = rnd(A, C)
        w[p + "self_attn.k_proj.weight"] = rnd(KV, C)
        w[p + "self_attn.v_proj.weight"] = rnd(KV, C)
        w[p + "self_attn.o_proj.weight"] = rnd(C, A)
        w[p + "mlp.gate_proj.weight"] = rnd(F, C)
        w[p + "mlp.up_proj.weight"] = rnd(F, C)
        w[p + "mlp.down_proj.weight"] = rnd(C, F)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_safetensors_np(os.path.join(d, "model.safetensors"), w)
    return d
