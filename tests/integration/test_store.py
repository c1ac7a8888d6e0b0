"""The replica store of a zworker (worker/store.c), spoken to directly.

A real zworker under a real zcoord; tickets are made here exactly as the
coordinator makes them (HMAC-SHA256 keyed with the holder's session, read
from the coordinator's SQLite file), so the test can send what a peer
could: a good copy is stored, and a forged, expired or foreign ticket, a
file of another job or generation, a wrong checksum and a truncated stream
are refused with a message naming the file, and leave nothing behind.
Connections that send nothing do not keep a peer with a ticket out.
"""
import hashlib
import hmac
import os
import socket
import sqlite3
import struct
import time

import xxhash

from ztest import start_fleet, wait_until


def worker_store(coord, name):
    with sqlite3.connect(coord.db) as db:
        row = db.execute("SELECT id, session, store_addr FROM workers WHERE name = ?",
                         (name,)).fetchone()
    return row[0], row[1], row[2]


def ticket(session, op, job, gen, requester, scope, ttl_s=60):
    exp = 0 if ttl_s is None else int((time.time() + ttl_s) * 1000)
    text = f"zt1|{op}|{job}|{gen}|{requester}|{exp}|{scope}"
    mac = hmac.new(session.encode(), text.encode(), hashlib.sha256).hexdigest()
    return f"{text}|{mac}"


def checksum(data):
    return "xxh64:" + xxhash.xxh64(data).hexdigest()


def request(addr, op, tk, d, name, data, declared=None, send=None):
    """One request; returns (status, message)."""
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        head = b"ZTS1" + op
        for part in (tk, d, name):
            b = part.encode()
            head += struct.pack("<H", len(b)) + b
        head += struct.pack("<Q", len(data)) + (declared or checksum(data)).encode()
        s.sendall(head + (data if send is None else send))
        if send is not None and len(send) < len(data):
            s.shutdown(socket.SHUT_WR)
        st = s.recv(1)
        if not st:
            return None, "closed"
        (n,) = struct.unpack("<H", s.recv(2))
        msg = b""
        while len(msg) < n:
            msg += s.recv(n - len(msg))
        return st[0], msg.decode()


def stored_unrecorded(reply):
    """The store took the copy (every check passed, the file is in place)
    but could not record it: the coordinator of these tests runs no such
    job, so it refuses the copy's report, and the store then refuses the
    push (status 1) rather than let the pusher count a copy nobody
    recorded."""
    st, msg = reply
    return st == 1 and "stored, but not recorded" in msg and "unknown job" in msg


def test_store_accepts_good_copies_and_refuses_the_rest(procs, tmp_path):
    coord = start_fleet(procs, 1)
    wid, session, addr = worker_store(coord, "w0")
    assert addr.startswith("127.0.0.1:")
    root = procs.root
    d = "st/job_5/step_00000010-g2"
    data = os.urandom(5000)
    put = ticket(session, "put", 5, 2, 99, "r1")

    # A good copy is stored under the worker's checkpoint root (and, as the
    # coordinator cannot record it, the pusher is told so).
    got = request(addr, b"P", put, d, "rank_1.bin", data)
    assert stored_unrecorded(got), got
    with open(os.path.join(root, d, "rank_1.bin"), "rb") as f:
        assert f.read() == data
    # ... and can be fetched back with a ticket for that epoch.
    get = ticket(session, "get", 5, 3, 99, d)
    st, _ = request(addr, b"G", get, d, "rank_1.bin", data)
    assert st == 0

    bad = [
        # (what, ticket, dir, name, declared checksum, bytes actually sent, expected message)
        ("forged", ticket("not-the-session", "put", 5, 2, 99, "r1"), d, "rank_1.bin", None,
         None, "not made for this worker"),
        ("expired", ticket(session, "put", 5, 2, 99, "r1", ttl_s=-5), d, "rank_1.bin", None,
         None, "expired"),
        ("other job", put, "st/job_6/step_00000010-g2", "rank_1.bin", None, None,
         "not an epoch"),
        ("other generation", put, "st/job_5/step_00000010-g3", "rank_1.bin", None, None,
         "not an epoch"),
        ("other rank", put, d, "rank_2.bin", None, None, "does not cover rank_2.bin"),
        ("not a checkpoint file", put, d, "evil.sh", None, None, "not a checkpoint file"),
        ("escape", put, "../../etc/job_5/step_00000010-g2", "rank_1.bin", None, None,
         "not a relative path"),
        ("wrong checksum", put, d, "rank_1.json", "xxh64:0000000000000000", None,
         "checksum"),
        ("get with a put ticket", put, d, "rank_1.bin", None, None, "for a put"),
        # A put ticket without an expiry (as the coordinator makes them) is
        # good only while the holder works on its generation; w0 is idle.
        ("generation not the holder's", ticket(session, "put", 5, 2, 99, "r1", ttl_s=None), d,
         "rank_1.bin", None, None, "this worker is on job 0 generation 0"),
    ]
    for what, tk, dd, name, declared, send, want in bad:
        op = b"G" if what.startswith("get") else b"P"
        st, msg = request(addr, op, tk, dd, name, data, declared, send)
        assert st == 1 and want in msg, (what, st, msg)
        if name == "rank_1.json":
            assert not os.path.exists(os.path.join(root, dd, name)), what
    # A stream cut short: nothing stored, the worker names the peer and file.
    st, msg = request(addr, b"P", put, d, "rank_1.json", data, send=data[:100])
    assert st in (None, 1)
    assert not os.path.exists(os.path.join(root, d, "rank_1.json"))
    assert not [f for f in os.listdir(os.path.join(root, d)) if f.endswith(".part")]
    wait_until(lambda: "rank_1.json from 127.0.0.1:" in coord.workers["w0"].output(), 10,
               "the refusal in the worker's log")


def test_store_takes_only_canonical_epoch_names(procs, tmp_path):
    """A push or fetch naming a directory or file in any other form than
    the checkpoint layout writes (signs, spaces, padding, hidden or extra
    components) is refused with a message, and creates nothing: the
    holdings scan would never list such a file, so it would never be
    deleted."""
    coord = start_fleet(procs, 1)
    _, session, addr = worker_store(coord, "w0")
    root = procs.root
    data = os.urandom(1000)
    put = ticket(session, "put", 1, 1, 99, "r1")
    good = "canon/job_1/step_00000005-g1"
    cases = [
        ("canon/job_+1/step_00000005-g1", "rank_1.bin", "not an epoch"),
        ("canon/job_ 1/step_00000005-g1", "rank_1.bin", "not an epoch"),
        ("canon/job_01/step_00000005-g1", "rank_1.bin", "not an epoch"),
        ("canon/job_1/step_-5-g1", "rank_1.bin", "not an epoch"),
        ("canon/job_1/step_5-g1", "rank_1.bin", "not an epoch"),
        ("canon/job_1/step_00000005-g+1", "rank_1.bin", "not an epoch"),
        (".hidden/job_1/step_00000005-g1", "rank_1.bin", "hidden component"),
        ("a/b/c/d/e/f/g/job_1/step_00000005-g1", "rank_1.bin", "directories deep"),
        (good, "rank_+1.bin", "not a checkpoint file"),
        (good, "rank_ 1.bin", "not a checkpoint file"),
        (good, "rank_01.bin", "not a checkpoint file"),
    ]
    for d, name, want in cases:
        st, msg = request(addr, b"P", put, d, name, data)
        assert st == 1 and want in msg, (d, name, st, msg)
        get = ticket(session, "get", 1, 1, 99, d)
        st, msg = request(addr, b"G", get, d, name, data)
        assert st == 1 and want in msg, ("get", d, name, st, msg)
    for top in ("canon", ".hidden", "a"):
        assert not os.path.exists(os.path.join(root, top)), f"a refused request made {top}"
    # The canonical form of the same is taken.
    got = request(addr, b"P", put, good, "rank_1.bin", data)
    assert stored_unrecorded(got), got
    assert os.path.exists(os.path.join(root, good, "rank_1.bin"))


def test_idle_connections_do_not_lock_out_a_peer_with_a_ticket(procs, tmp_path):
    """Sixteen connections that never send a byte (as many as the store
    serves transfers at once) neither refuse nor delay a good push."""
    coord = start_fleet(procs, 1)
    _, session, addr = worker_store(coord, "w0")
    host, port = addr.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(16)]
    try:
        d = "st/job_7/step_00000010-g1"
        data = os.urandom(3000)
        t0 = time.monotonic()
        got = request(addr, b"P", ticket(session, "put", 7, 1, 99, "r0"), d, "rank_0.bin", data)
        took = time.monotonic() - t0
        assert stored_unrecorded(got), got
        assert took < 3, f"the push took {took:.1f} s behind idle connections"
        # The idle ones are cut off after the header's deadline, not held
        # for the length of a transfer.
        wait_until(lambda: coord.workers["w0"].output().count("no request from") >= 16, 15,
                   "the idle connections dropped for not sending their header")
    finally:
        for s in idle:
            s.close()


def test_refusals_log_peer_text_escaped(procs, tmp_path):
    """A directory or file name from a peer is logged with its control
    characters escaped: a newline in it cannot start a forged log line."""
    coord = start_fleet(procs, 1)
    _, session, addr = worker_store(coord, "w0")
    put = ticket(session, "put", 5, 2, 99, "r1")
    data = os.urandom(100)
    for d, name in (("st\nFAKE dir/job_5/step_00000010-g2", "rank_1.bin"),
                    ("st/job_5/step_00000010-g2", "\nFAKE name\x1b[2J")):
        st, msg = request(addr, b"P", put, d, name, data)
        assert st == 1, (d, name, st, msg)
    wait_until(lambda: coord.workers["w0"].output().count("refused PUT") >= 2, 10,
               "both refusals in the worker's log")
    out = coord.workers["w0"].output()
    assert not [l for l in out.splitlines() if l.startswith("FAKE")], out
    assert "\x1b" not in out
    assert "st\\x0aFAKE dir" in out and "\\x0aFAKE name\\x1b[2J" in out
