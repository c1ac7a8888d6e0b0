"""zprep: byte tokenizer, shard format and splitting, and GPT-2 BPE against an
independent Python implementation of OpenAI's encoder.py.

No vocabulary files can be downloaded here, so the BPE test trains a small
merge table (a few hundred merges) on real English text with a simple BPE
learner written below, writes it as encoder.json + vocab.bpe in GPT-2's
formats, and checks that zprep and the reference encoder (encoder.py's bpe()
and byte mapping, with the pre-tokenization pattern approximated in `re`,
since Debian's python has no `regex` module) produce identical tokens on
real text plus a line of accented letters, curly quotes, digits and
whitespace runs.
"""
import collections
import json
import os
import re
import struct
import subprocess

import pytest

from ztest import BIN, bytes_to_unicode

FORTUNES = "/usr/share/games/fortunes"
MAGIC = 20240520


def zprep(*args, check=True):
    r = subprocess.run([os.path.join(BIN, "zprep"), *map(str, args)], capture_output=True,
                       text=True, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"zprep failed ({r.returncode}): {r.stderr}")
    return r


def read_shard(path):
    data = open(path, "rb").read()
    hdr = struct.unpack("<256i", data[:1024])
    assert hdr[0] == MAGIC and hdr[1] == 1
    assert len(data) == 1024 + 2 * hdr[2]
    return list(struct.unpack(f"<{hdr[2]}H", data[1024:]))


def shards(d, prefix, split):
    names = sorted(n for n in os.listdir(d) if n.startswith(f"{prefix}_{split}_"))
    return [os.path.join(d, n) for n in names]


# ---- byte tokenizer ------------------------------------------------------------

def test_byte_documents_and_split(tmp_path):
    a = tmp_path / "a.txt"
    b = tmp_path / "b.txt"
    a.write_bytes(b"first doc\n%\nsecond\r\n%\n\xc3\xa9t\xc3\xa9\n")
    b.write_bytes(b"whole file")
    out = tmp_path / "out"
    r = zprep(a, b, "-o", out, "--doc-sep", "%", "--val-fraction", "0.5", "--prefix", "t")
    assert "4 documents" in r.stdout and "vocab_size 257" in r.stdout
    docs = [b"first doc\n", b"second\r\n", "été\n".encode(), b"whole file"]
    # Documents 1 and 3 (every second one) go to validation.
    want_train = [256, *docs[0], 256, *docs[2]]
    want_val = [256, *docs[1], 256, *docs[3]]
    assert [read_shard(p) for p in shards(out, "t", "train")] == [want_train]
    assert [read_shard(p) for p in shards(out, "t", "val")] == [want_val]
    # The tokenizer record beside the shards (docs/engine.md, "Tokenizer record").
    assert json.load(open(out / "t_tokenizer.json")) == {"type": "byte", "vocab_size": 257,
                                                        "eot": 256}
    assert sorted(os.listdir(out)) == ["t_tokenizer.json", "t_train_000000.bin",
                                       "t_val_000000.bin"]


def test_byte_shard_size_limit(tmp_path):
    src = tmp_path / "in.txt"
    text = bytes(range(32, 127)) * 7
    src.write_bytes(text)
    out = tmp_path / "out"
    zprep(src, "-o", out, "--shard-tokens", "100", "--val-fraction", "0")
    paths = shards(out, "data", "train")
    assert len(paths) == (len(text) + 1 + 99) // 100
    toks = [read_shard(p) for p in paths]
    assert all(len(t) == 100 for t in toks[:-1])
    assert sum(toks, []) == [256, *text]
    assert shards(out, "data", "val") == []
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_usage_errors(tmp_path):
    assert zprep(check=False).returncode == 2
    assert zprep(tmp_path / "x", check=False).returncode == 2  # no -o
    r = zprep(tmp_path / "missing.txt", "-o", tmp_path / "o", check=False)
    assert r.returncode == 1 and "missing.txt" in r.stderr
    r = zprep(tmp_path / "x", "-o", tmp_path / "o", "--tokenizer", "gpt2", check=False)
    assert r.returncode == 2 and "--encoder" in r.stderr


# ---- GPT-2 BPE ---------------------------------------------------------------------

# GPT-2's pattern with \p{L} -> [^\W\d_], \p{N} -> \d (re has no \p{..}).
PAT = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


def get_pairs(word):
    return set(zip(word, word[1:]))


class Encoder:
    """OpenAI's gpt-2/src/encoder.py, reduced to encoding."""

    def __init__(self, encoder, merges):
        self.encoder = encoder
        self.byte_encoder = bytes_to_unicode()
        self.bpe_ranks = dict(zip(merges, range(len(merges))))

    def bpe(self, token):
        word = tuple(token)
        pairs = get_pairs(word)
        if not pairs:
            return token
        while True:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                    new_word.extend(word[i:j])
                    i = j
                except ValueError:
                    new_word.extend(word[i:])
                    break
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            word = tuple(new_word)
            if len(word) == 1:
                break
            pairs = get_pairs(word)
        return " ".join(word)

    def encode(self, text):
        ids = []
        for token in PAT.findall(text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(token).split(" "))
        return ids


def learn_bpe(text, n_merges):
    """A plain BPE learner over pre-tokenized words (most frequent pair first,
    ties broken by the pair itself)."""
    be = bytes_to_unicode()
    words = collections.Counter(
        tuple(be[b] for b in tok.encode("utf-8")) for tok in PAT.findall(text))
    merges = []
    for _ in range(n_merges):
        counts = collections.Counter()
        for w, c in words.items():
            for p in zip(w, w[1:]):
                counts[p] += c
        if not counts:
            break
        best = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        nw = collections.Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            nw[tuple(out)] += c
        words = nw
    vocab = [be[b] for b in range(256)] + [a + b for a, b in merges]
    encoder = {}
    for t in vocab:
        encoder.setdefault(t, len(encoder))
    encoder["<|endoftext|>"] = len(encoder)
    return encoder, merges


def fortune_text(name, limit):
    path = os.path.join(FORTUNES, name)
    if not os.path.exists(path):
        pytest.skip(f"{path} missing (Debian package fortunes)")
    return open(path, encoding="utf-8", errors="replace").read()[:limit]


EXTRA = ("Café naïve façade — “quoted” ‘single’ don't I'll we've they're I'm he'd it's\n"
         "  numbers 123,456.78 and x2 and ½ mixed_under_score   tabs\t\tand   spaces   \n\n"
         "\n trailing space \n   ")


def test_gpt2_bpe_matches_reference(tmp_path):
    train_text = fortune_text("fortunes", 60000) + EXTRA
    encoder, merges = learn_bpe(train_text, 300)
    (tmp_path / "encoder.json").write_text(json.dumps(encoder, ensure_ascii=False))
    with open(tmp_path / "vocab.bpe", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(f"{a} {b}\n")
    enc = Encoder(encoder, merges)
    # Real text the merges were not learned on, plus the tricky line. "½" is
    # a number to GPT-2's regex but alphanumeric to re; keep it out.
    text = fortune_text("literature", 80000) + EXTRA.replace("½", "")
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    r = zprep(tmp_path / "in.txt", "-o", out, "--tokenizer", "gpt2", "--encoder",
              tmp_path / "encoder.json", "--bpe", tmp_path / "vocab.bpe", "--val-fraction", "0")
    assert f"vocab_size {len(encoder)}" in r.stdout
    got = sum((read_shard(p) for p in shards(out, "data", "train")), [])
    want = [encoder["<|endoftext|>"], *enc.encode(text)]
    assert len(got) == len(want)
    first_diff = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
    assert first_diff is None, f"first difference at token {first_diff}"
    assert len(want) < 0.6 * len(text.encode())  # the merges do compress
    # The record names copies of the two files, beside it.
    rec = json.load(open(out / "data_tokenizer.json"))
    assert rec == {"type": "gpt2", "vocab_size": len(encoder), "eot": encoder["<|endoftext|>"],
                   "encoder": "data_encoder.json", "bpe": "data_vocab.bpe"}
    assert (out / "data_encoder.json").read_bytes() == (tmp_path / "encoder.json").read_bytes()
    assert (out / "data_vocab.bpe").read_bytes() == (tmp_path / "vocab.bpe").read_bytes()
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_gpt2_bad_files(tmp_path):
    (tmp_path / "in.txt").write_text("hello")
    (tmp_path / "encoder.json").write_text(json.dumps({"a": 0}))
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\n")
    r = zprep(tmp_path / "in.txt", "-o", tmp_path / "o", "--tokenizer", "gpt2", "--encoder",
              tmp_path / "encoder.json", "--bpe", tmp_path / "vocab.bpe", check=False)
    assert r.returncode == 1 and "<|endoftext|>" in r.stderr
    assert not os.path.exists(tmp_path / "o" / "data_tokenizer.json")
