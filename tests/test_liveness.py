"""Whether a peer's process is gone, asked of real p2p daemons on loopback."""

import asyncio
import os
import signal
import subprocess
import sys

from dht.node import LOOPBACK, DHTConfig, start_dht
from peer.averaging.liveness import failed_fast_everywhere, gone

PEER = "12D3KooWLtvT7fvQVPbUxsm1dKmsRAXtE2xfBX1JDLrLWmCrpZao"


def test_only_a_fast_failure_on_every_address_counts_as_gone():
    # libp2p's errors as the daemon words them (seen on loopback)
    refused = (f"Connect failed. msg=failed to dial: failed to dial {PEER}: all dials failed\n"
               "  * [/ip4/127.0.0.1/tcp/43305] dial tcp4 127.0.0.1:43305: connect: connection refused")
    assert failed_fast_everywhere(refused)
    backoff = (f"Connect failed. msg=failed to dial: failed to dial {PEER}: all dials failed\n"
               "  * [/ip4/127.0.0.1/tcp/43305] dial backoff")
    assert failed_fast_everywhere(backoff)  # a dial just failed (usually someone else's, to the same dead peer)
    timed_out = refused + "\n  * [/ip4/10.0.0.2/tcp/43305] dial tcp4 10.0.0.2:43305: i/o timeout"
    assert not failed_fast_everywhere(timed_out)  # one address may still lead to the peer
    assert not failed_fast_everywhere("Connect failed. msg=failed to find any peer in table")


def test_a_killed_peer_is_gone_and_a_live_one_is_not():
    """A peer whose process group was SIGKILLed refuses every dial within the probe; a live one answers."""
    me = start_dht(DHTConfig(host_maddrs=(LOOPBACK,)))
    maddrs = [str(m) for m in me.get_visible_maddrs()]
    script = ("import sys, time; from dht.node import LOOPBACK, DHTConfig, start_dht; "
              f"d = start_dht(DHTConfig(host_maddrs=(LOOPBACK,), initial_peers=tuple({maddrs!r}))); "
              "print(d.peer_id.to_base58(), flush=True); time.sleep(120)")
    others = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               start_new_session=True) for _ in range(2)]
    try:
        victim, survivor = [proc.stdout.readline().strip() for proc in others]

        async def probe():
            p2p = await me.replicate_p2p()
            before = await gone(p2p, [victim, survivor])
            os.killpg(others[0].pid, signal.SIGKILL)
            others[0].wait(10)
            # our daemon may still hold its connection to the victim for a moment: the first dial after it
            # closes is refused
            deadline = asyncio.get_event_loop().time() + 10
            while not (after := await gone(p2p, [victim, survivor])) and asyncio.get_event_loop().time() < deadline:
                await asyncio.sleep(0.2)
            return before, after

        before, after = asyncio.run(probe())
        assert before == [] and after == [victim]
    finally:
        for proc in others:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        me.shutdown()
