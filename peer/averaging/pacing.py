"""Pacing a peer's sends below its uplink (``--max-upload``), so that control messages never queue behind a round.

On a saturated uplink every byte waits behind the bytes written before it: in the p2p daemon's TCP send buffer
(megabytes, seconds at a home rate) and in the router's queue. A DHT read or a matchmaking reply then arrives
seconds late, groups miss members, and rounds are lost (bench/results/wan.md, "The hard row"). A ``Pacer`` spaces
the averager process's bulk sends (all-reduce parts, round results, state downloads) so that on average they leave
no faster than the rate: a send waits until the bytes reserved before it have drained at that rate, so the queues
below stay short. Small messages (matchmaking, a result's status) are counted against the rate but never wait:
they go ahead of the bulk, as they should.

The queue below the p2p daemon is the host's: ``socket_queue_hint`` says how to bound it, for a peer whose all-reduce
lost a connection to a reset.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

CHUNK_BYTES = 16 * 1024  # a bulk message is written in pieces of this size, each when it is due
SMALL_BYTES = 4 * 1024  # messages up to this size are never held back (control, not bulk)


class Pacer:
    """A virtual clock of the uplink: ``reserve(n)`` books n bytes after everything booked before, at ``rate``
    bytes a second, and says how long to wait until they are due (0 on an idle link)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic):
        if not rate > 0:
            raise ValueError(f"the pacing rate must be positive, got {rate}")
        self.rate, self.clock = rate, clock
        self.free_at = float("-inf")  # when the bytes booked so far will have left

    def reserve(self, size: int) -> float:
        now = self.clock()
        start = max(self.free_at, now)
        self.free_at = start + size / self.rate
        return start - now

    @classmethod
    def from_mbit(cls, mbit: float, clock: Callable[[], float] = time.monotonic) -> "Pacer":
        return cls(mbit * 1e6 / 8, clock)


NOTSENT_LOWAT = "/proc/sys/net/ipv4/tcp_notsent_lowat"  # Linux: most unsent bytes a TCP socket queues
LOWAT_BYTES = 16384  # what the hard row measured with (bench/results/wan.md)


def socket_queue_hint(path: Optional[str] = None) -> Optional[str]:
    """A line for a user whose all-reduce lost a connection to a reset, where the host lets sockets queue without
    bound (Linux's default); None where the bound is set already, or the host has no such setting.

    On a thin uplink the p2p daemon's multiplexer (go-yamux) closes a connection whose socket write waits past its
    5-10-s deadline, and Linux wakes a blocked writer only once a third of the socket's autotuned buffer has left:
    at 1 Mbit/s shared by three groupmates, that took longer. Bounding the unsent bytes keeps each write short:
    whole rounds on the hard row went from 4-21 failed all-reduces a run to none in two runs (bench/results/wan.md,
    "What resets whole rounds' connections"). Nothing in a user's process can set it for the daemon's sockets."""
    try:
        with open(path or NOTSENT_LOWAT) as f:
            value = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if value <= 4 * LOWAT_BYTES:
        return None
    return (f"a connection was reset mid all-reduce: on a thin uplink the p2p daemon closes a connection whose socket "
            f"queue drains too slowly; `sudo sysctl -w net.ipv4.tcp_notsent_lowat={LOWAT_BYTES}` keeps that queue "
            f"short (README, \"A thin or shared uplink\")")
