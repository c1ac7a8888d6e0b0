"""mhnet: hosts on one machine, each in its own network namespace.

A Net is a Linux bridge with one veth pair per host; each host is a network
namespace with its own address on the bridge's /24 and its own directory,
so no directory is shared between hosts. Processes run inside a host's
namespace (`ip netns exec`). The bridge itself has the subnet's .1, so the
test process reaches every host directly. Faults act on a host's link:

  net.link_down(h) / link_up(h)   the host's veth (no FIN, no RST)
  net.blackhole(a, b)             a can no longer reach b (nor b a: replies
                                  are dropped), both still reach everyone else
  net.slow(h, "10mbit")           tbf on the host's link

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
