"""One-way delay and packet loss on a namespace's link, in user space (this kernel has no netem).

    python -m docker.forwarder --host-tap ddnXXXXt0 --namespace ddn-XXXX-0 --delay-ms 25 --loss 0.005

``docker/netns.py`` gives a namespace with delay or loss a TAP device ``eth0`` inside it and a TAP
device on the host's bridge instead of a veth pair, and starts one forwarder per namespace. The
forwarder opens the host TAP, enters the namespace (``setns``) and opens its ``eth0``, then copies
Ethernet frames between the two: each frame waits ``--delay-ms`` and is dropped with probability
``--loss``, independently in each direction. Frames leave in the order they came (a constant delay
keeps it), and a frame that cannot be written (its link is down: a cut cable) is lost. Rate limits
stay in the kernel: tbf on the TAP devices, as on veths.

It prints ``ready`` once both devices are open and runs until killed; it dies with its parent.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import errno
import fcntl
import os
import random
import select
import signal
import struct
import sys
import time
from typing import Deque, Dict, Tuple

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
CLONE_NEWNET = 0x40000000
FRAME = 1 << 16  # larger than any MTU a TAP device takes
BATCH = 64  # frames read from one device before looking at the other


def open_tap(name: str) -> int:
    """Attach to the (persistent) TAP device ``name`` in this process's network namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def enter_namespace(name: str) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(fd)


def pump(a: int, b: int, delay: float, loss: float, rng: random.Random) -> None:
    """Copy frames a -> b and b -> a, each held ``delay`` seconds and dropped with probability ``loss``."""
    queues: Dict[int, Deque[Tuple[float, bytes]]] = {a: collections.deque(), b: collections.deque()}
    other = {a: b, b: a}
    while True:
        now = time.monotonic()
        due = [queue[0][0] - now for queue in queues.values() if queue]
        readable, _, _ = select.select([a, b], [], [], max(0.0, min(due)) if due else None)
        now = time.monotonic()
        for fd in readable:
            for _ in range(BATCH):
                try:
                    frame = os.read(fd, FRAME)
                except BlockingIOError:
                    break
                except OSError as e:  # EIO while the device is down
                    if e.errno != errno.EIO:
                        raise
                    break
                if not loss or rng.random() >= loss:
                    queues[fd].append((now + delay, frame))
        for fd, queue in queues.items():
            while queue and queue[0][0] <= now:
                _, frame = queue.popleft()
                try:
                    os.write(other[fd], frame)
                except OSError:  # the receiving side is down or full: the frame is lost, as on a wire
                    pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docker.forwarder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host-tap", required=True, help="TAP device on the host's bridge")
    parser.add_argument("--namespace", required=True, help="network namespace whose TAP device is eth0")
    parser.add_argument("--tap", default="eth0", help="the TAP device inside the namespace (default eth0)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added to every frame, each direction")
    parser.add_argument("--loss", type=float, default=0.0, help="probability a frame is dropped, each direction")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    if args.delay_ms < 0 or not 0 <= args.loss < 1:
        parser.error("--delay-ms must be >= 0 and --loss in [0, 1)")
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the network's owner
    host = open_tap(args.host_tap)
    enter_namespace(args.namespace)
    inside = open_tap(args.tap)
    print("ready", flush=True)
    pump(host, inside, args.delay_ms / 1000, args.loss, random.Random(args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
