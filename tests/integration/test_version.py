"""--version on every binary: "NAME X.Y.Z", the version of CMakeLists.txt's
project(), and the git revision of the checkout it was built from (current
at each build, not the one of the configure step)."""
import os
import re
import subprocess

import pytest

from ztest import BIN, SRC

BINARIES = ["zcoord", "zworker", "zctl", "zprep", "ztrain", "zsolo"]


def project_version():
    text = open(os.path.join(SRC, "CMakeLists.txt")).read()
    m = re.search(r"project\(ztrain VERSION (\d+\.\d+\.\d+)", text)
    assert m, "no project(ztrain VERSION x.y.z) in CMakeLists.txt"
    return m.group(1)


def git_head():
    """The checkout's short HEAD, or None when SRC is not its own git tree."""
    try:
        top = subprocess.run(["git", "-C", SRC, "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True, timeout=30)
        if top.returncode != 0 or os.path.realpath(top.stdout.strip()) != os.path.realpath(SRC):
            return None
        head = subprocess.run(["git", "-C", SRC, "rev-parse", "--short=7", "HEAD"],
                              capture_output=True, text=True, timeout=30, check=True)
        return head.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def version_of(path):
    r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    return r.returncode, r.stdout, r.stderr


@pytest.mark.parametrize("name", BINARIES)
def test_version(name):
    rc, out, err = version_of(os.path.join(BIN, name))
    assert rc == 0, err
    assert re.match(rf"^{name} \d+\.\d+\.\d+", out), out
    lines = out.splitlines()
    assert len(lines) == 1 and err == "", (out, err)
    m = re.match(rf"^{name} (\d+\.\d+\.\d+)(?: \(git ([0-9a-f]{{7,}})(-dirty)?\))?$", lines[0])
    assert m, f"unexpected --version line: {lines[0]!r}"
    assert m.group(1) == project_version()
    head = git_head()
    if head is not None:
        assert m.group(2) == head, f"{lines[0]!r} does not name HEAD {head}"


def test_all_binaries_agree():
    """One generated source for all: every binary prints the same version."""
    versions = {version_of(os.path.join(BIN, n))[1].split(" ", 1)[1] for n in BINARIES}
    assert len(versions) == 1, versions


def test_generator_follows_the_checkout(tmp_path):
    """common/version.cmake (run at every build) names the revision of the
    moment, marks local changes, names none outside a git checkout, and
    leaves its output untouched when the text would not change (so an
    unchanged revision recompiles nothing)."""
    repo, out = tmp_path / "src", tmp_path / "zt_version.c"
    repo.mkdir()
    script = os.path.join(SRC, "common", "version.cmake")

    def generate():
        subprocess.run(["cmake", f"-DSRC={repo}", f"-DOUT={out}", "-DVERSION=9.8.7", "-P", script],
                       check=True, capture_output=True, timeout=60)
        return re.search(r'return "([^"]*)"', out.read_text()).group(1)

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                               *args], check=True, capture_output=True, text=True,
                              timeout=60).stdout.strip()

    (repo / "f.txt").write_text("one\n")
    assert generate() == "9.8.7"                  # not a git checkout (yet)
    git("init", "-q")
    git("add", "f.txt")
    git("commit", "-q", "-m", "one")
    first = git("rev-parse", "--short=7", "HEAD")
    assert generate() == f"9.8.7 (git {first})"
    mtime = out.stat().st_mtime_ns
    assert generate() == f"9.8.7 (git {first})" and out.stat().st_mtime_ns == mtime
    (repo / "f.txt").write_text("two\n")
    assert generate() == f"9.8.7 (git {first}-dirty)"
    (repo / "untracked.txt").write_text("x\n")     # untracked files are not changes
    git("commit", "-q", "-am", "two")
    second = git("rev-parse", "--short=7", "HEAD")
    assert second != first and generate() == f"9.8.7 (git {second})"
    # A tree inside another checkout is not that checkout's revision.
    (repo / "sub").mkdir()
    subprocess.run(["cmake", f"-DSRC={repo / 'sub'}", f"-DOUT={out}", "-DVERSION=9.8.7", "-P",
                    script], check=True, capture_output=True, timeout=60)
    assert 'return "9.8.7";' in out.read_text()
