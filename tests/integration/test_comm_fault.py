"""Collectives across real processes: a rank killed (SIGKILL) or frozen
(SIGSTOP) mid-collective makes every other rank fail within the configured
timeout, never hang."""
import signal
import time

import pytest

from ztest import BIN, SLOW, free_port, wait_until

TIMEOUT_MS = 1500


def start_ring(procs, world, timeout_ms=TIMEOUT_MS):
    peers = ",".join(f"127.0.0.1:{free_port()}" for _ in range(world))
    ranks = [procs.start(f"rank{r}", [f"{BIN}/zt_commrun", "--rank", str(r), "--world",
                                      str(world), "--peers", peers, "--sizes", "8M",
                                      "--iters", "100000", "--warmup", "0",
                                      "--timeout-ms", str(timeout_ms)])
             for r in range(world)]
    wait_until(lambda: all("running" in p.output() for p in ranks), 30, "ring running")
    return ranks


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_dead_or_silent_rank_fails_others_within_timeout(procs, how):
    ranks = start_ring(procs, 4)
    victim = ranks[2]
    t0 = time.monotonic()
    victim.signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    others = [p for i, p in enumerate(ranks) if i != 2]
    exit_at = {}

    def all_exited():
        for p in others:
            if p.name not in exit_at and not p.alive():
                exit_at[p.name] = time.monotonic() - t0
        return len(exit_at) == len(others)
    wait_until(all_exited, 30, "surviving ranks to fail", interval=0.01)
    for p in others:
        assert p.p.returncode == 3, p.output()
        assert "comm error" in p.output()
    worst = max(exit_at.values())
    # A dead peer is seen at once; a silent one after the timeout, and the
    # failure then cascades around the ring as ranks close their sockets.
    bound = (0.5 if how == "kill" else TIMEOUT_MS / 1000 + 0.5) * SLOW
    assert worst <= bound, f"slowest rank failed after {worst:.2f}s, bound {bound:.2f}s: {exit_at}"
    if how == "stop":
        victim.signal(signal.SIGCONT)
        victim.kill()
