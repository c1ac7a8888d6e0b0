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
import resource
import shutil
import signal
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


def read_shard(path, version=1):
    """A shard's tokens; version 1 holds uint16 tokens, version 2 uint32."""
    data = open(path, "rb").read()
    hdr = struct.unpack("<256i", data[:1024])
    width = {1: 2, 2: 4}[version]
    assert hdr[0] == MAGIC and hdr[1] == version, hdr[:3]
    assert len(data) == 1024 + width * hdr[2]
    return list(struct.unpack(f"<{hdr[2]}{'H' if width == 2 else 'I'}", data[1024:]))


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


def test_token_bytes_4_writes_version_2_shards(tmp_path):
    """--token-bytes 4 writes 32-bit tokens (shard version 2, for
    vocabularies past 65,536 ids): the same tokens as the 16-bit default."""
    src = tmp_path / "in.txt"
    src.write_bytes(b"one\n%\ntwo three\n%\nfour \xe2\x82\xac\n")
    zprep(src, "-o", tmp_path / "a", "--doc-sep", "%", "--val-fraction", "0.5")
    zprep(src, "-o", tmp_path / "b", "--doc-sep", "%", "--val-fraction", "0.5",
          "--token-bytes", "4")
    for split in ("train", "val"):
        narrow = [read_shard(p) for p in shards(tmp_path / "a", "data", split)]
        wide = [read_shard(p, version=2) for p in shards(tmp_path / "b", "data", split)]
        assert narrow and wide == narrow, split
    for bad in ("3", "8", "x", ""):
        r = zprep(src, "-o", tmp_path / "c", "--token-bytes", bad, check=False)
        assert r.returncode == 2 and "--token-bytes" in r.stderr, (bad, r.stderr)
    assert not (tmp_path / "c").exists()


def test_usage_errors(tmp_path):
    assert zprep(check=False).returncode == 2
    assert zprep(tmp_path / "x", check=False).returncode == 2  # no -o
    r = zprep(tmp_path / "missing.txt", "-o", tmp_path / "o", check=False)
    assert r.returncode == 1 and "missing.txt" in r.stderr
    r = zprep(tmp_path / "x", "-o", tmp_path / "o", "--tokenizer", "gpt2", check=False)
    assert r.returncode == 2 and "--encoder" in r.stderr


def test_numeric_options_and_prefix_are_checked(tmp_path):
    """A value with trailing text ("100M") is an error naming the option,
    not the number it starts with; a --prefix with '/' is refused. Nothing
    is written."""
    src = tmp_path / "in.txt"
    src.write_bytes(b"some text")
    out = tmp_path / "out"
    for args, opt in ((["--shard-tokens", "100M"], "--shard-tokens"),
                      (["--shard-tokens", "12x"], "--shard-tokens"),
                      (["--shard-tokens", ""], "--shard-tokens"),
                      (["--shard-tokens", "0"], "--shard-tokens"),
                      (["--val-fraction", "0.5x"], "--val-fraction"),
                      (["--val-fraction", ""], "--val-fraction"),
                      (["--val-fraction", "1"], "--val-fraction"),
                      (["--prefix", "sub/name"], "--prefix"),
                      (["--prefix", "../up"], "--prefix")):
        r = zprep(src, "-o", out, *args, check=False)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert opt in r.stderr and "usage" not in r.stderr, (args, r.stderr)
        assert "\n" not in r.stderr.strip(), (args, r.stderr)
    assert not out.exists() and not (tmp_path / "up_tokenizer.json").exists()


def test_a_second_run_into_the_same_place_is_refused(tmp_path):
    """Numbering restarts at 0, so a second run into the same DIR and PREFIX
    would mix its shards with the first run's: refused (exit 2, naming a
    file), the first data set untouched. Another prefix is another data
    set; a failed run's shards (no record yet) and a lone record count."""
    src = tmp_path / "in.txt"
    src.write_bytes(bytes(range(32, 127)) * 5)
    out = tmp_path / "out"
    zprep(src, "-o", out, "--shard-tokens", "100", "--val-fraction", "0")
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    assert len(shards(out, "data", "train")) == 5
    small = tmp_path / "small.txt"
    small.write_bytes(b"short")
    r = zprep(small, "-o", out, "--shard-tokens", "100", "--val-fraction", "0", check=False)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert f"{out} already holds a data set (data_" in r.stderr, r.stderr
    assert "remove it or use another --prefix" in r.stderr, r.stderr
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    # Another prefix in the same directory is another data set.
    zprep(small, "-o", out, "--prefix", "data_train", "--val-fraction", "0")
    assert [read_shard(p) for p in shards(out, "data_train", "train")] == [[256, *b"short"]]
    # What a failed run leaves (shards, no record), and a record alone.
    for name in ("old_val_000003.bin", "rec_tokenizer.json"):
        (out / name).write_bytes(b"x")
        r = zprep(small, "-o", out, "--prefix", name.split("_")[0], check=False)
        assert r.returncode == 2 and f"already holds a data set ({name})" in r.stderr, r.stderr


def test_a_failed_write_leaves_no_temporary(tmp_path):
    """A shard that cannot be written (here: past the file size limit) is
    an error naming the file, and its temporary file is removed."""
    src = tmp_path / "in.txt"
    src.write_bytes(b"x" * 5000)
    out = tmp_path / "out"
    out.mkdir()

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    r = subprocess.run([os.path.join(BIN, "zprep"), str(src), "-o", str(out),
                        "--val-fraction", "0"], capture_output=True, text=True, timeout=120,
                       preexec_fn=small_files)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"{out}/data_train_000000.bin.tmp: write: File too large" in r.stderr, r.stderr
    assert os.listdir(out) == []


def syscalls(trace):
    """(call, args...) from an strace -f log: fsync and rename with the
    paths their descriptors were opened with."""
    fds, calls = {}, []
    for line in trace.splitlines():
        m = re.match(r"\d+\s+(\w+)\((.*)\)\s+= (-?\d+)", line)
        if not m:
            continue
        name, args, ret = m.group(1), m.group(2), int(m.group(3))
        paths = re.findall(r'"((?:[^"\\]|\\.)*)"', args)
        if name == "openat" and ret >= 0:
            fds[ret] = paths[0]
        elif name == "close":
            fds.pop(int(args), None)
        elif name in ("fsync", "fdatasync") and ret == 0:
            calls.append(("fsync", fds.get(int(args))))
        elif name.startswith("rename") and ret == 0:
            calls.append(("rename", paths[0], paths[1]))
    return calls


def test_files_are_durable_before_and_after_the_rename(tmp_path):
    """Every file (shards and record) is fsync'ed under its temporary name
    before the rename, and the directory after it: a crash cannot leave a
    renamed but empty shard."""
    strace = shutil.which("strace")
    if not strace:
        pytest.skip("no strace")
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_bytes(bytes(range(32, 127)) * 2)
    b.write_bytes(bytes(range(32, 127)) * 2)
    out = tmp_path / "out"
    log = tmp_path / "trace"
    r = subprocess.run([strace, "-f", "-o", str(log), "-e",
                        "trace=openat,close,fsync,fdatasync,rename,renameat,renameat2",
                        os.path.join(BIN, "zprep"), str(a), str(b), "-o", str(out),
                        "--shard-tokens", "100", "--val-fraction", "0.5"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0 and not log.exists():
        pytest.skip(f"strace cannot trace here: {r.stderr}")
    assert r.returncode == 0, r.stderr
    calls = syscalls(log.read_text())
    renames = [i for i, c in enumerate(calls) if c[0] == "rename"]
    assert len(renames) == len(os.listdir(out)) == 5, calls  # 2 + 2 shards, the record
    for k, i in enumerate(renames):
        _, tmp, final = calls[i]
        assert tmp == final + ".tmp", calls[i]
        start = renames[k - 1] + 1 if k else 0
        end = renames[k + 1] if k + 1 < len(renames) else len(calls)
        assert ("fsync", tmp) in calls[start:i], (final, calls[start:i])
        assert ("fsync", os.path.dirname(final)) in calls[i + 1:end], (final, calls[i + 1:end])


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
