"""The installed product: the .deb that `cpack -G DEB` makes from the build
directory under test, and `cmake --install --prefix`.

The package is unpacked with `dpkg-deb -x` into a throw-away root: it needs
no privileges and no dpkg database, so the test runs the same as root or
not, and changes nothing on the machine (`dpkg --root` would need a dpkg
database in the root and, unprivileged, fails to chown). The checks: the
control fields and file list, units that name the installed binaries and
settings, Depends covering every library the installed files link, and the
installed zcoord serving its dashboard from the installed share directory.
"""
import glob
import json
import os
import re
import secrets
import shutil
import signal
import subprocess

import pytest

from ztest import BIN, SRC, http_get, wait_until

BUILD = os.environ.get("ZT_BUILD") or os.path.dirname(os.path.abspath(BIN))
BINARIES = ["zcoord", "zworker", "zctl", "zprep", "ztrain", "zsolo"]
UNITS = ["zcoord.service", "zworker@.service"]
WEB = ["index.html", "app.js", "style.css"]
SETTINGS = ["zcoord.json", "zworker.env"]
CUDA_LIB = os.path.join(BUILD, "lib", "libzt_kernels_cuda.so")

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("cpack", "dpkg-deb", "readelf", "dpkg")),
    reason="needs cpack, dpkg-deb, readelf and dpkg")


def run(argv, **kw):
    r = subprocess.run(argv, capture_output=True, text=True, timeout=240, **kw)
    assert r.returncode == 0, f"{' '.join(argv)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def project_version():
    text = open(os.path.join(SRC, "CMakeLists.txt")).read()
    return re.search(r"project\(ztrain VERSION (\d+\.\d+\.\d+)", text).group(1)


@pytest.fixture(scope="module")
def deb(tmp_path_factory):
    """Builds the .deb (into a temporary directory) and unpacks it."""
    out = tmp_path_factory.mktemp("deb")
    env = {k: v for k, v in os.environ.items() if k != "DESTDIR"}
    run(["cpack", "--config", os.path.join(BUILD, "CPackConfig.cmake"), "-G", "DEB",
         "-B", str(out)], cwd=BUILD, env=env)
    debs = glob.glob(str(out / "ztrain_*.deb"))
    assert len(debs) == 1, debs
    root = tmp_path_factory.mktemp("root")
    run(["dpkg-deb", "-x", debs[0], str(root)])
    return {"path": debs[0], "root": str(root)}


def field(deb_path, name):
    return run(["dpkg-deb", "-f", deb_path, name]).strip()


def unit_settings(path):
    """Key -> list of values of a unit file."""
    keys = {}
    for line in open(path):
        line = line.strip()
        if line and not line.startswith(("#", "[")) and "=" in line:
            k, v = line.split("=", 1)
            keys.setdefault(k, []).append(v)
    return keys


def check_units(unitdir, bindir, etcdir, docdir, inside):
    """The units name the installed binaries, settings and docs; inside(p)
    maps an absolute path of the installed system to where it lies now."""
    for unit in UNITS:
        s = unit_settings(os.path.join(unitdir, unit))
        exe = s["ExecStart"][0].split()
        want = os.path.join(bindir, "zcoord" if unit == "zcoord.service" else "zworker")
        assert exe[0] == want, (unit, exe[0], want)
        assert os.access(inside(exe[0]), os.X_OK), exe[0]
        if unit == "zcoord.service":
            # The 0600 config reaches the dynamic user as a credential.
            assert exe[exe.index("--config") + 1] == "%d/zcoord.json"
            name, conf = s["LoadCredential"][0].split(":", 1)
            assert name == "zcoord.json" and conf == os.path.join(etcdir, "ztrain", "zcoord.json")
            assert os.path.isfile(inside(conf)), conf
        else:
            envf = s["EnvironmentFile"][0]
            assert envf == os.path.join(etcdir, "ztrain", "zworker.env")
            assert os.path.isfile(inside(envf)), envf
            # Every variable ExecStart uses is set by the unit itself or the
            # shipped env file; the drain timeout has a default in the unit,
            # so an env file from before it still starts the worker.
            unit_env = {e.split("=", 1)[0] for e in s.get("Environment", [])}
            file_env = {l.split("=", 1)[0] for l in open(inside(envf))
                        if "=" in l and not l.startswith("#")}
            used = set(re.findall(r"\$\{(\w+)\}", s["ExecStart"][0]))
            assert used <= unit_env | file_env, used - unit_env - file_env
            assert "ZTRAIN_DRAIN_TIMEOUT_MS" in unit_env and "--drain-timeout-ms" in exe
        doc = s["Documentation"][0]
        assert doc == "file://" + os.path.join(docdir, "architecture.md")
        assert os.path.isfile(inside(doc[len("file://"):])), doc
        if not bindir.startswith("/usr/local/"):
            assert "/usr/local/" not in open(os.path.join(unitdir, unit)).read(), unit


# ---- the .deb ------------------------------------------------------------------

def test_deb_control(deb):
    assert field(deb["path"], "Package") == "ztrain"
    assert field(deb["path"], "Version") == project_version()
    depends = {d.strip() for d in field(deb["path"], "Depends").split(",")}
    assert {"libc6", "libuv1", "libgrpc29", "libsqlite3-0", "libsystemd0",
            "libmicrohttpd12"} <= depends, depends
    conffiles = subprocess.run(f"dpkg-deb --ctrl-tarfile {deb['path']} | tar -xO ./conffiles",
                               shell=True, capture_output=True, text=True, timeout=60).stdout
    assert sorted(conffiles.split()) == [f"/etc/ztrain/{c}" for c in SETTINGS]


def test_deb_file_list(deb):
    listing = run(["dpkg-deb", "-c", deb["path"]])
    files = {l.split()[-1].lstrip(".") for l in listing.splitlines() if not l.startswith("d")}
    want = {f"/usr/bin/{b}" for b in BINARIES}
    want |= {f"/usr/lib/systemd/system/{u}" for u in UNITS}
    want |= {f"/usr/share/ztrain/web/{w}" for w in WEB}
    want |= {f"/etc/ztrain/{c}" for c in SETTINGS}
    want |= {"/usr/share/doc/ztrain/architecture.md", "/usr/share/doc/ztrain/deploy.md"}
    want |= {"/usr/share/ztrain/slurm/zworker.sbatch", "/usr/share/ztrain/slurm/ztrain-provision"}
    assert want <= files, sorted(want - files)
    cuda = [f for f in files if f.endswith("/libzt_kernels_cuda.so")]
    if os.path.exists(CUDA_LIB):
        assert cuda == ["/usr/lib/ztrain/libzt_kernels_cuda.so"], cuda
    else:
        assert not cuda
    # Nothing outside /usr and /etc/ztrain (no build or staging paths).
    stray = [f for f in files if not f.startswith(("/usr/", "/etc/ztrain/"))
             or f.startswith("/usr/local/")]
    assert not stray, stray
    for b in BINARIES:
        assert os.access(os.path.join(deb["root"], "usr/bin", b), os.X_OK), b


def test_deb_units_name_installed_files(deb):
    root = deb["root"]
    check_units(os.path.join(root, "usr/lib/systemd/system"), "/usr/bin", "/etc",
                "/usr/share/doc/ztrain", lambda p: os.path.join(root, p.lstrip("/")))


def soname_paths(elf):
    """NEEDED soname -> the path the loader resolves it to (None: not found)."""
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]",
                        run(["readelf", "-d", elf]))
    found = {}
    for line in subprocess.run(["ldd", elf], capture_output=True, text=True,
                               timeout=60).stdout.splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if m:
            found[m.group(1)] = None if m.group(2) == "not" else m.group(2)
        elif re.match(r"\s*/\S+ \(0x", line):  # the dynamic loader, by its path
            path = line.split()[0]
            found[os.path.basename(path)] = path
    return {n: found.get(n) for n in needed}


def owner(path):
    """The Debian package that ships path (usrmerge: /lib is /usr/lib)."""
    cands = [path, os.path.realpath(path)]
    for c in list(cands):
        if c.startswith("/usr/lib/"):
            cands.append(c[len("/usr"):])
        elif c.startswith("/lib/"):
            cands.append("/usr" + c)
    for c in cands:
        r = subprocess.run(["dpkg", "-S", c], capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            return r.stdout.split(":")[0].split(",")[0].strip()
    return None


def test_deb_depends_cover_linked_libraries(deb):
    """Every library an installed binary (or the CUDA library) links comes
    from a package of Depends; libopenblas0 stands for its variants."""
    depends = {d.strip().split()[0] for d in field(deb["path"], "Depends").split(",")}
    elves = [os.path.join(deb["root"], "usr/bin", b) for b in BINARIES]
    elves += glob.glob(os.path.join(deb["root"], "usr/lib/**/*.so"), recursive=True)
    missing = []
    for elf in elves:
        for soname, path in soname_paths(elf).items():
            if elf.endswith("libzt_kernels_cuda.so") and soname.startswith("libcu"):
                continue  # the CUDA toolkit's (cuBLASLt): not a Debian package here
            assert path, f"{os.path.basename(elf)}: {soname} not found"
            pkg = owner(path)
            assert pkg, f"{os.path.basename(elf)}: {soname} ({path}) is in no package"
            ok = pkg in depends or (pkg.startswith("libopenblas0-") and "libopenblas0" in depends)
            if not ok:
                missing.append(f"{os.path.basename(elf)}: {soname} from {pkg}")
    assert not missing, f"not in Depends {sorted(depends)}: {missing}"


def test_deb_binaries_print_version(deb):
    for b in BINARIES:
        r = subprocess.run([os.path.join(deb["root"], "usr/bin", b), "--version"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and re.match(rf"^{b} {re.escape(project_version())}\b",
                                              r.stdout), (b, r.stdout, r.stderr)


def test_deb_zcoord_serves_installed_dashboard(deb, procs, tmp_path):
    """The installed zcoord, with the installed settings (secrets filled in,
    paths and ports made local), serves /healthz and the dashboard from
    <root>/usr/share/ztrain/web, found relative to its own path."""
    root = deb["root"]
    web = os.path.join(root, "usr/share/ztrain/web")
    marker = f"<!-- installed copy {secrets.token_hex(8)} -->"
    with open(os.path.join(web, "index.html"), "a") as f:
        f.write(marker + "\n")
    conf = json.load(open(os.path.join(root, "etc/ztrain/zcoord.json")))
    state = tmp_path / "state"
    state.mkdir()
    conf.update({"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", "db": str(state / "zcoord.db"),
                 "data_root": str(state), "checkpoint_root": str(state),
                 "api_token": secrets.token_hex(32), "worker_secret": secrets.token_hex(32),
                 "ready_file": str(state / "ready.json")})
    cfg = tmp_path / "zcoord.json"
    cfg.write_text(json.dumps(conf))
    coord = procs.start("zcoord-installed", [os.path.join(root, "usr/bin/zcoord"),
                                             "--config", str(cfg)])

    def ready():
        assert coord.alive(), coord.output()
        with open(state / "ready.json") as f:
            return json.load(f)
    port = wait_until(ready, 10, "the installed zcoord's ready file")["http_port"]
    wait_until(lambda: http_get(port, "/healthz")[0] == 200, 10, "/healthz 200")
    status, ctype, body = http_get(port, "/")
    assert status == 200 and ctype.startswith("text/html") and marker in body, (status, body[:200])
    status, _, body = http_get(port, "/static/app.js")
    assert status == 200 and body == open(os.path.join(web, "app.js")).read()
    coord.signal(signal.SIGTERM)
    assert coord.wait(10) == 0, coord.output()


@pytest.mark.skipif(not os.path.exists(CUDA_LIB), reason="built without CUDA")
def test_deb_zworker_finds_installed_cuda_kernels(deb, tmp_path):
    """zworker --device cuda:0 from the unpacked root loads the kernel
    library from <root>/usr/lib/ztrain. It checks the device first and
    its work directory next, which is made impossible here, so it exits
    either way: refusing the GPU (none here) or the work directory (a GPU)."""
    (tmp_path / "file").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "ZT_CUDA_KERNELS"}
    r = subprocess.run([os.path.join(deb["root"], "usr/bin/zworker"), "--coordinator",
                        "127.0.0.1:1", "--name", "w", "--workdir", str(tmp_path / "file" / "w"),
                        "--device", "cuda:0", "--data-root", str(tmp_path),
                        "--checkpoint-root", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, env=env)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "cannot load the CUDA kernels" not in out, out
    assert "--device cuda:0: cuda:0:" in out or "--workdir" in out, out


# ---- cmake --install ---------------------------------------------------------

@pytest.mark.parametrize("layout", ["prefix", "destdir-usr"])
def test_cmake_install(layout, tmp_path):
    """`cmake --install --prefix P` (settings in P/etc/ztrain) and with
    DESTDIR and the /usr prefix (settings in /etc/ztrain, as in the .deb):
    the same files, units naming the final paths, and a second install
    keeps the operator's settings."""
    env = {k: v for k, v in os.environ.items() if k != "DESTDIR"}
    if layout == "prefix":
        prefix, etc = str(tmp_path / "pfx"), str(tmp_path / "pfx" / "etc")
        inside = lambda p: p  # noqa: E731
    else:
        prefix, etc = "/usr", "/etc"
        env["DESTDIR"] = str(tmp_path / "dest")
        inside = lambda p: str(tmp_path / "dest") + p  # noqa: E731

    def install():
        run(["cmake", "--install", BUILD, "--prefix", prefix], env=env)
    install()
    for b in BINARIES:
        assert os.access(inside(f"{prefix}/bin/{b}"), os.X_OK), b
    for w in WEB:
        assert os.path.isfile(inside(f"{prefix}/share/ztrain/web/{w}")), w
    for c in SETTINGS:
        assert os.path.isfile(inside(f"{etc}/ztrain/{c}")), c
    check_units(inside(f"{prefix}/lib/systemd/system"), f"{prefix}/bin", etc,
                f"{prefix}/share/doc/ztrain", inside)
    if os.path.exists(CUDA_LIB):
        assert os.path.isfile(inside(f"{prefix}/lib/ztrain/libzt_kernels_cuda.so"))
    # The operator's settings survive; a damaged unit is put back.
    conf = inside(f"{etc}/ztrain/zcoord.json")
    with open(conf, "a") as f:
        f.write("\n# edited\n")
    os.unlink(inside(f"{prefix}/lib/systemd/system/zcoord.service"))
    install()
    assert open(conf).read().endswith("# edited\n")
    assert os.path.isfile(inside(f"{prefix}/lib/systemd/system/zcoord.service"))
