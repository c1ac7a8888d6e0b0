"""zctl sample and zsolo sample: text from a committed checkpoint.

A tiny job is trained under a real zcoord and two zworkers on shards zprep
made (so the epochs' manifests name zprep's tokenizer record), then:
sampling is reproducible for a seed and differs between seeds, greedy
zctl output equals zsolo's on the same epoch directory, each token reaches
stdout as its own write (strace), the context limit stops a run, and every
bad input is a one-line error with a non-zero exit and no output.
"""
import glob
import json
import os
import shutil
import subprocess

import pytest

from ztest import BIN, SLOW, english_text, start_fleet, submit, tiny_spec, wait_job, write_shard, \
    zctl_json

T = 32  # the tiny model's seq_len


def run(*argv, check=True):
    """A binary of ours with bytes on stdout (sampled bytes need not be UTF-8)."""
    r = subprocess.run([os.path.join(BIN, argv[0]), *map(str, argv[1:])], capture_output=True,
                       timeout=60 * SLOW)
    r.stderr = r.stderr.decode(errors="replace")
    if check and r.returncode != 0:
        raise AssertionError(f"{argv} failed ({r.returncode}): {r.stderr}")
    return r


def zctl_sample(coord, *args, check=True):
    return run("zctl", "--coordinator", coord.grpc, "sample", *args, check=check)


def fails(r, expect):
    """A one-line error naming the problem, a non-zero exit, nothing on stdout."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and r.stdout == b"", r
    assert len(lines) == 1 and expect in lines[0], (expect, r.stderr)


def zprep_dataset(d):
    """Byte shards of real English with zprep's tokenizer record beside them."""
    os.makedirs(d, exist_ok=True)
    src = os.path.join(d, "corpus.txt")
    with open(src, "wb") as f:
        f.write(english_text(200_000))
    run("zprep", src, "-o", d, "--doc-sep", "%", "--prefix", "f")
    return os.path.join(d, "f_train_*.bin"), os.path.join(d, "f_val_*.bin")


def epochs_of(coord, jid):
    return {c["step"]: c["dir"] for c in zctl_json(coord.grpc, "checkpoints", str(jid))[
        "checkpoints"] if c["state"] == "committed"}


def test_sample(procs, tmp_path):
    train, val = zprep_dataset(str(tmp_path / "data"))
    record = str(tmp_path / "data" / "f_tokenizer.json")
    assert json.load(open(record)) == {"type": "byte", "vocab_size": 257, "eot": 256}
    coord = start_fleet(procs, 2, timeout_ms=None)
    spec = tiny_spec(train, val, 30, stage=1, workers=2,
                     checkpoint={"dir": str(tmp_path / "ck"), "every_steps": 20})
    jid = submit(coord, spec, tmp_path)
    wait_job(coord, jid)
    epochs = epochs_of(coord, jid)
    assert json.load(open(os.path.join(epochs[30], "manifest.json")))["tokenizer"] == \
        os.path.realpath(record)

    # The same seed twice: the same text; another seed: another text.
    args = ["--prompt", "The ", "--tokens", "20", "--temperature", "1"]
    a = zctl_sample(coord, jid, *args, "--seed", "5")
    b = zctl_sample(coord, jid, *args, "--seed", "5")
    c = zctl_sample(coord, jid, *args, "--seed", "6")
    assert a.stdout == b.stdout != c.stdout
    assert a.stdout.startswith(b"The ") and a.stdout.endswith(b"\n")
    summary = a.stderr.strip().splitlines()
    assert len(summary) == 1 and "zctl: 20 tokens in" in summary[0] and "tokens/s" in summary[0]
    assert "(step 30," in summary[0] and "byte tokenizer" in summary[0], summary
    # 20 byte tokens (the end-of-text token prints as <|endoftext|>)
    body = a.stdout[4:-1]
    assert len(body.replace(b"<|endoftext|>", b"#")) == 20, body
    # top-k 1 is greedy whatever the temperature and seed
    greedy = zctl_sample(coord, jid, "--prompt", "The ", "--tokens", "20", "--temperature", "0")
    k1 = zctl_sample(coord, jid, *args, "--top-k", "1", "--seed", "9")
    assert greedy.stdout == k1.stdout

    # Greedy: zctl on the job equals zsolo on the epoch directory (and --dir, no coordinator).
    g = ["--prompt", "A fortune", "--tokens", "15", "--temperature", "0"]
    z1 = zctl_sample(coord, jid, *g)
    z2 = run("zsolo", "sample", epochs[30], *g)
    z3 = run("zctl", "--coordinator", "127.0.0.1:1", "sample", "--dir", epochs[30], *g)
    assert z1.stdout == z2.stdout == z3.stdout
    assert "zsolo: 15 tokens in" in z2.stderr
    s20 = zctl_sample(coord, jid, "--step", "20", *g)
    assert "(step 20," in s20.stderr
    assert s20.stdout == run("zsolo", "sample", epochs[20], *g).stdout

    # The context: 1 end-of-text + 10 prompt tokens + at most 21 new ones = seq_len.
    full = zctl_sample(coord, jid, "--prompt", "0123456789", "--tokens", "100", "--seed", "1")
    assert "the context is full (seq_len 32)" in full.stderr and "zctl: 21 tokens in" in full.stderr
    # A prompt of 30 bytes leaves room for exactly one token; 31 for none.
    one = zctl_sample(coord, jid, "--prompt", "x" * 30, "--tokens", "5")
    assert "zctl: 1 tokens in" in one.stderr
    fails(zctl_sample(coord, jid, "--prompt", "x" * 31, check=False),
          "the prompt is 32 tokens with the leading end-of-text, the model's context is 32")

    # Streaming: the prompt, each token and the final newline are separate writes to stdout.
    strace = shutil.which("strace")
    if strace:
        log = str(tmp_path / "strace.txt")
        r = subprocess.run([strace, "-f", "-e", "trace=write", "-o", log,
                            os.path.join(BIN, "zsolo"), "sample", epochs[30], *args, "--seed", "5"],
                           capture_output=True, timeout=60 * SLOW)
        assert r.returncode == 0 and r.stdout == a.stdout
        writes = [ln for ln in open(log) if "write(1," in ln]
        assert len(writes) == 1 + 20 + 1, writes

    # Bad input: each a one-line error, a non-zero exit, no output.
    fails(zctl_sample(coord, jid, "--prompt", "x", "--temperature", "-1", check=False),
          "--temperature must be a number >= 0")
    fails(zctl_sample(coord, jid, "--prompt", "x", "--tokens", "0", check=False),
          "--tokens: expected an integer in 1..")
    fails(zctl_sample(coord, jid, "--prompt", "x", "--top-k", "-3", check=False),
          "--top-k: expected an integer in 0..")
    fails(zctl_sample(coord, jid, "--prompt", "x", "--seed", "abc", check=False),
          "--seed: expected an integer")
    fails(run("zsolo", "sample", epochs[30], "--tokens", "x", check=False),
          "--tokens: expected an integer")
    fails(zctl_sample(coord, jid, "--step", "7", "--prompt", "x", check=False),
          f"job {jid} has no committed checkpoint at step 7")
    fails(zctl_sample(coord, jid, "--prompt", "x", "--tokenizer", str(tmp_path / "nope.json"),
                      check=False), "nope.json: No such file")
    bad = tmp_path / "bad_tokenizer.json"
    bad.write_text('{"type": "byte", "vocab_size": 257')
    fails(zctl_sample(coord, jid, "--prompt", "x", "--tokenizer", str(bad), check=False),
          "not valid JSON")
    bad.write_text('{"type": "gpt2", "vocab_size": 257, "eot": 256}')
    fails(run("zsolo", "sample", epochs[30], "--prompt", "x", "--tokenizer", bad, check=False),
          '"encoder" and "bpe" must be file names')
    fails(run("zsolo", "sample", str(tmp_path / "no_epoch"), "--prompt", "x", check=False),
          "no_epoch/manifest.json: No such file")
    # The record the manifest names has gone: an error saying so, unless --tokenizer.
    os.rename(record, record + ".moved")
    fails(zctl_sample(coord, jid, "--prompt", "x", check=False), "the checkpoint's tokenizer")
    zctl_sample(coord, jid, "--prompt", "x", "--tokenizer", record + ".moved", "--tokens", "3")

    # A job with no committed epoch.
    nock = submit(coord, tiny_spec(train, val, 3, workers=1), tmp_path, "nock.json")
    wait_job(coord, nock)
    fails(zctl_sample(coord, nock, "--prompt", "x", check=False),
          f"job {nock} has no committed checkpoint")

    # A model whose vocabulary is smaller than the byte tokenizer's: ASCII only.
    text = bytes(b for b in english_text(200_000) if b < 128)
    d = tmp_path / "ascii"
    os.makedirs(d)
    write_shard(str(d / "train_000000.bin"), list(text[20_000:]))
    write_shard(str(d / "val_000000.bin"), list(text[:20_000]))
    small = tiny_spec(str(d / "train_*.bin"), str(d / "val_*.bin"), 10, workers=1,
                      checkpoint={"dir": str(tmp_path / "ck2"), "every_steps": 10})
    small["model"]["vocab_size"] = 128
    js = submit(coord, small, tmp_path, "small.json")
    wait_job(coord, js)
    fails(zctl_sample(coord, js, "--prompt", "hello", check=False),
          "the checkpoint names no tokenizer and its vocabulary is 128 tokens")
    byte_rec = tmp_path / "byte.json"
    byte_rec.write_text('{"type":"byte","vocab_size":257,"eot":256}')
    fails(zctl_sample(coord, js, "--prompt", "h\u00e9llo", "--tokenizer", byte_rec, check=False),
          "prompt byte 0xc3 is token 195, outside the model's vocabulary of 128")
    ok = zctl_sample(coord, js, "--prompt", "hello", "--tokenizer", byte_rec, "--tokens", "30")
    assert ok.stdout.startswith(b"hello") and all(b < 128 for b in ok.stdout)
    # no end-of-text in this vocabulary: the prompt alone is the context
    assert "prompt 5 tokens" in ok.stderr
    fails(zctl_sample(coord, js, "--prompt", "", "--tokenizer", byte_rec, check=False),
          "the prompt is empty and the model has no end-of-text token")
