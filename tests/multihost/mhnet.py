"""mhnet: hosts on one machine, each in its own network namespace.

A Net is a Linux bridge with one veth pair per host; each host is a network
namespace with its own address on the bridge's /24 and its own directory,
so no directory is shared between hosts. Processes run inside a host's
namespace (`ip netns exec`). The bridge itself has the subnet's .1, so the
test process reaches every host directly. Faults act on a host's link:

  net.link_down(h) / link_up(h)   the host's veth (no FIN, no RST)
  net.blackhole(a, b)             a can no longer reach b (nor b a: replies
                                  are dropped), both still reach everyone else;
                                  a's own sends to b fail at once (the route)
  net.lose(a, b) / unlose(a, b)   frames from a to b lost on a's link without
                                  a word: a's connections to b and b's to a
                                  wait out their deadlines, as across a
                                  real one-way fault
  net.slow(h, "10mbit")           tbf on the host's link (not with lose())

Names carry a tag made from the test process's pid, so two runs do not
collide; close() kills every process and deletes every namespace and link
even when a test failed, and a failed set-up undoes what it did. Needs
root and iproute2; `available()` says why not otherwise.
"""
import os
import shutil
import subprocess

from ztest import Proc


def sh(*argv, check=True):
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")
    return r


def available():
    """None when namespaces can be made here, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip"):
        return "iproute2 (ip) is not installed"
    tag = f"ztprobe{os.getpid() % 100000}"
    r = sh("ip", "netns", "add", tag, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    sh("ip", "netns", "del", tag, check=False)
    return None


class Host:
    def __init__(self, net, name, index):
        self.net, self.name, self.index = net, name, index
        self.ns = f"{net.tag}-{name}"
        self.addr = f"{net.prefix}.{10 + index}"
        self.veth = f"{net.tag}{index}"  # the bridge side
        self.dir = os.path.join(net.root, name)
        os.makedirs(self.dir, exist_ok=True)

    def run(self, name, argv, env=None):
        """Starts argv inside this host; the Proc is killed by net.close()."""
        p = Proc(f"{self.name}-{name}", ["ip", "netns", "exec", self.ns] + list(argv),
                 self.net.root, env)
        self.net.procs.append(p)
        return p

    def kill_all(self):
        """Every process of this host, as a machine that vanishes."""
        self.net.kill_hosts(self)


class Net:
    def __init__(self, root):
        self.root = root
        pid = os.getpid()
        self.tag = f"zm{pid % 10000}"
        self.prefix = f"10.213.{pid % 250}"
        self.bridge = f"{self.tag}br"
        self.hosts, self.procs, self.made = {}, [], []
        self.losing = {}  # host name -> addresses its frames to are lost (lose())
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        sh("ip", "addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")

    def add_host(self, name):
        h = Host(self, name, len(self.hosts))
        sh("ip", "netns", "add", h.ns)
        self.made.append(("netns", h.ns))
        peer = h.veth + "p"
        sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", peer)
        self.made.append(("link", h.veth))
        sh("ip", "link", "set", peer, "netns", h.ns)
        sh("ip", "link", "set", h.veth, "master", self.bridge)
        sh("ip", "link", "set", h.veth, "up")
        for cmd in (("ip", "addr", "add", f"{h.addr}/24", "dev", peer),
                    ("ip", "link", "set", peer, "up"), ("ip", "link", "set", "lo", "up")):
            sh("ip", "netns", "exec", h.ns, *cmd)
        self.hosts[name] = h
        return h

    def kill_hosts(self, *hosts):
        """Every process of these hosts at once, as machines that vanish
        together: SIGKILL goes to all of them before any is waited for, so
        no survivor can copy anything from one while the other is already
        gone."""
        victims = [p for p in self.procs if p.name.startswith(tuple(h.name + "-" for h in hosts))]
        for p in victims:
            if p.alive():
                p.p.kill()
        for p in victims:
            p.kill()  # reaps it

    def link_down(self, h):
        sh("ip", "link", "set", h.veth, "down")

    def link_up(self, h):
        sh("ip", "link", "set", h.veth, "up")

    def blackhole(self, a, b):
        sh("ip", "netns", "exec", a.ns, "ip", "route", "add", "blackhole", f"{b.addr}/32")

    def unblackhole(self, a, b):
        sh("ip", "netns", "exec", a.ns, "ip", "route", "del", "blackhole", f"{b.addr}/32")

    def lose(self, a, b):
        """Frames from a to b are lost on a's link: an htb root whose class
        for them queues nothing (pfifo limit 0), chosen by a u32 match on
        the destination, so no tc action module is needed."""
        self.losing.setdefault(a.name, set()).add(b.addr)
        self._shape_losses(a)

    def unlose(self, a, b):
        self.losing.get(a.name, set()).discard(b.addr)
        self._shape_losses(a)

    def _shape_losses(self, a):
        dev = a.veth + "p"
        tc = ("ip", "netns", "exec", a.ns, "tc")
        sh(*tc, "qdisc", "del", "dev", dev, "root", check=False)
        if not self.losing.get(a.name):
            return
        sh(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
        for c in ("1:1", "1:2"):
            sh(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", c, "htb", "rate",
               "10gbit")
        sh(*tc, "qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", "pfifo", "limit",
           "0")
        for addr in sorted(self.losing[a.name]):
            sh(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
               "u32", "match", "ip", "dst", f"{addr}/32", "flowid", "1:2")

    def slow(self, h, rate, burst="32kbit"):
        """tbf on the host's egress; a fast rate needs a burst of at least
        rate / HZ (bench/overlap passes one)."""
        sh("ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev", h.veth + "p", "root",
           "tbf", "rate", rate, "burst", burst, "latency", "400ms")

    def close(self):
        for p in self.procs:
            p.kill()
            p.log.close()
        for kind, name in reversed(self.made):
            if kind == "netns":
                sh("ip", "netns", "del", name, check=False)
            else:
                sh("ip", "link", "del", name, check=False)

    def dump(self):
        return "\n".join(f"----- {p.name} -----\n{p.output()[-6000:]}" for p in self.procs)
