"""A test network of Linux network namespaces, for machines without a docker engine (needs root).

    python -m docker.netns --peers 4 [--rate-mbit 100] [--delay-ms 50] [--loss 0.01] [--behind-nat 3]

creates one namespace per peer, prints each one's address and the command prefix that runs a process
inside it, and the host address for a bootstrap node, then waits; Ctrl+C or SIGTERM removes it all.
Tests use ``TestNetwork`` directly to cut one peer off (``link_down``) or split the swarm (``partition``).

Layout: namespace i has ``eth0`` = 10.k.0.(i+1)/24 and ``lo``; the other end of its veth pair sits in
the host namespace on one bridge, which holds 10.k.0.254/24 (``host_ip``), so a process on the host
(a bootstrap node) is reachable from every namespace. k is a free subnet index in 100..199. With a
rate, both directions of every link are shaped with tbf.

Delay and loss: this kernel has no netem, so a namespace's link is then a pair of TAP devices (``eth0``
inside, one on the bridge) joined by a user-space forwarder (``docker/forwarder.py``), one process per
namespace. ``delay_ms`` is the one-way delay between two peers and ``loss`` the chance a packet between
two peers is lost: each link holds half the delay and a loss of 1 - sqrt(1 - loss), each way, so a
peer's packets cross two links to another peer (one to the host). The TAPs' MTU is ``tap_mtu``: large frames
where the forwarder would otherwise copy too many, Ethernet's where the link is thin; link cuts, partitions and
rates work as with veths.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import random
import re
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys

PREFIX = "ddn"  # every namespace and interface name starts with it (Linux interface names: at most 15 chars)
SUBNETS = range(100, 200)  # 10.k.0.0/24 for one of these k
HOST_OCTET = 254
LATENCY_MS = 50  # what the shaper's queue holds, in time at its rate
TAP_MTU = (1500, 64000)  # Ethernet's frame, and the largest a TAP carries here
SEGMENTS_IN_FLIGHT = 16  # frames a round trip and the shaper's queue hold at least, where the MTU allows
READY_SECONDS = 30.0


def _run(argv: list[str], check: bool = True) -> str:
    """Run an iproute2 command and return its stdout; a failure raises with its stderr when ``check``."""
    result = subprocess.run(argv, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{shlex.join(argv)}` failed: {result.stderr.strip() or result.returncode}")
    return result.stdout


@functools.lru_cache(maxsize=None)
def available() -> tuple[bool, str]:
    """Whether this machine can build a ``TestNetwork``, and why not: needs Linux, root and iproute2."""
    if not sys.platform.startswith("linux"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}-probe-{secrets.token_hex(2)}"
    try:  # everything a TestNetwork needs, built inside a throwaway namespace so the host is untouched
        _run(["ip", "netns", "add", probe])
        try:
            _run(["ip", "-n", probe, "link", "add", "name", "br0", "type", "bridge"])
            _run(["ip", "-n", probe, "link", "add", "name", "v0", "type", "veth", "peer", "name", "v1"])
        finally:
            _run(["ip", "netns", "del", probe], check=False)
    except RuntimeError as e:
        return False, str(e)
    return True, ""


def tap_mtu(rate_mbit: float | None, delay_ms: float) -> int:
    """The MTU of an emulated link's TAPs: as large as lets a round trip plus the shaper's queue hold
    ``SEGMENTS_IN_FLIGHT`` frames, within ``TAP_MTU``.

    TCP recovers a lost segment fast only with several in flight (three duplicate ACKs); with fewer it waits out a
    retransmission timeout. At 1 Mbit/s and 100 ms a round trip, 64000-byte frames left one or two in flight: a
    quarter to a third of all segments were retransmitted, and each namespace counted hundreds of retransmission
    timeouts in minutes (``bench/results/wan.md``). A home uplink carries 1500-byte frames. An unshaped link keeps
    the largest, so the forwarder copies few frames."""
    if rate_mbit is None:
        return TAP_MTU[1]
    held = rate_mbit * 1e6 / 8 * (2 * delay_ms + LATENCY_MS) / 1000  # bytes: a round trip's, and the queue's
    return int(min(TAP_MTU[1], max(TAP_MTU[0], held / SEGMENTS_IN_FLIGHT)))


def _free_subnet() -> int:
    """A random k in SUBNETS with no 10.k.x.x or 11.k.x.x address or route on this host (other live networks use
    theirs).

    Checked, not reserved: two networks created in the same instant could, rarely, pick the same k.
    """
    used = _run(["ip", "-4", "-o", "addr", "show"]) + _run(["ip", "-4", "route", "show", "table", "all"])
    taken = {int(k) for k in re.findall(r"(?<![\d.])1[01]\.(\d+)\.", used)}
    free = [k for k in SUBNETS if k not in taken]
    if not free:
        raise RuntimeError(f"no free subnet 10.k.0.0/24 with k in {SUBNETS.start}..{SUBNETS.stop - 1}")
    return random.choice(free)


class TestNetwork:
    """``size`` network namespaces on one bridge with the host, optionally rate-limited; a context manager.

    Names carry a random ``tag`` (namespace ``ddn-<tag>-<i>``, interfaces ``ddn<tag>...``), so several
    networks can live side by side. ``close`` removes everything, and runs at exit if a test never gets to.
    """

    __test__ = False  # a helper, not a pytest test class

    def __init__(self, size: int, rate_mbit: float | None = None, delay_ms: float = 0.0, loss: float = 0.0,
                 behind_nat: tuple[int, ...] = (), routable: bool = False, notsent_lowat: int | None = None):
        if size < 1 or size >= HOST_OCTET:
            raise ValueError(f"size must be in 1..{HOST_OCTET - 1}, got {size}")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        if delay_ms < 0 or not 0 <= loss < 1:
            raise ValueError(f"delay_ms must be >= 0 and loss in [0, 1), got {delay_ms} and {loss}")
        self.size, self.rate_mbit, self.delay_ms, self.loss = size, rate_mbit, delay_ms, loss
        # most unsent bytes a TCP socket queues, as a host tuned with `sysctl net.ipv4.tcp_notsent_lowat` (None: the
        # kernel's default, no bound; peer/averaging/pacing.py: socket_queue_hint)
        self.notsent_lowat = notsent_lowat
        self.emulated = bool(delay_ms or loss)  # TAP devices and forwarders instead of veth pairs
        self.behind_nat = frozenset(self._index(i) for i in behind_nat)
        # 11.k.0.0/24 instead of 10.k.0.0/24: addresses libp2p takes for public ones, as a relay's must be (its
        # autorelay drops private relay addresses); the range is routed only to this network's bridge
        self.first_octet = 11 if routable else 10
        self._forwarders: list[subprocess.Popen] = []
        self.tag = secrets.token_hex(2)
        self.subnet = _free_subnet()
        self.bridge = f"{PREFIX}{self.tag}br"
        self._namespaces: list[str] = []  # what exists, for close() after a failure half-way
        self._bridges: list[str] = []
        self._partitioned: set[int] = set()  # namespaces whose veth is on a partition bridge
        self._closed = False
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TestNetwork:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ip(self, i: int) -> str:
        """The address of namespace ``i`` (on its ``eth0``); behind NAT, a private one nobody outside can dial."""
        if self._index(i) in self.behind_nat:
            return f"192.168.{i + 1}.2"
        return self.public_ip(i)

    def public_ip(self, i: int) -> str:
        """Where namespace ``i``'s traffic comes from on the bridge: its own address, or its NAT router's."""
        return f"{self.first_octet}.{self.subnet}.0.{self._index(i) + 1}"

    @property
    def host_ip(self) -> str:
        """The host's address on the bridge: a server bound here (or on 0.0.0.0) is reachable from every namespace."""
        return f"{self.first_octet}.{self.subnet}.0.{HOST_OCTET}"

    def namespace(self, i: int) -> str:
        """The name of namespace ``i`` (where its processes run), as ``ip netns`` knows it."""
        return self._edge(i) + ("h" if self._index(i) in self.behind_nat else "")

    def _edge(self, i: int) -> str:
        """The namespace on the bridge for ``i``: ``i`` itself, or its NAT router (home namespace ``<edge>h``)."""
        return f"{PREFIX}-{self.tag}-{self._index(i)}"

    def wrap(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``i``, for ``subprocess.Popen``.

        ``ip netns exec`` switches namespace and execs the command in place, so the Popen's pid is the
        command's pid (checked in tests) and signals reach it directly. It also gives the command its own
        mount namespace with /sys remounted for the namespace; the filesystem is otherwise the host's.
        """
        return ["ip", "netns", "exec", self.namespace(i), *argv]

    def link_down(self, i: int) -> None:
        """Pull namespace ``i``'s cable: its ``eth0`` loses carrier and nothing gets in or out until ``link_up``."""
        _run(["ip", "link", "set", self._veth(i), "down"])

    def link_up(self, i: int) -> None:
        """Plug namespace ``i`` back in; as after ``heal``, a connect may need a retry in the first seconds."""
        _run(["ip", "link", "set", self._veth(i), "up"])

    def partition(self, *groups: list[int]) -> None:
        """Split the namespaces into ``groups`` that cannot reach each other.

        The first group stays on the main bridge with the host (so do namespaces named in no group); each
        other group gets a bridge of its own and cannot reach the host. Replaces any earlier partition.
        """
        named = [self._index(i) for group in groups for i in group]
        if len(named) != len(set(named)):
            raise ValueError(f"a namespace is in more than one group: {groups}")
        self.heal()
        for g, group in enumerate(groups[1:], start=1):
            bridge = f"{PREFIX}{self.tag}p{g}"
            self._add_bridge(bridge)
            # no ARP: the host would otherwise answer for host_ip on this bridge too (Linux answers for any
            # local address on any interface), and the group would half-reach the host
            _run(["ip", "link", "set", bridge, "arp", "off"])
            for i in group:
                _run(["ip", "link", "set", self._veth(i), "master", bridge])
                self._partitioned.add(i)

    def heal(self) -> None:
        """Undo ``partition``: every namespace back on the main bridge, the partition bridges deleted.

        Nothing is flushed, as after a real outage: for a second or two a connect may still wait for an ARP
        probe (one a second) or fail with "no route to host" (an entry that gave up during the cut); callers
        retry, as peers do.
        """
        for i in sorted(self._partitioned):
            _run(["ip", "link", "set", self._veth(i), "master", self.bridge])
        self._partitioned.clear()
        for bridge in self._bridges[1:]:
            _run(["ip", "link", "del", bridge])
        del self._bridges[1:]

    def close(self) -> None:
        """Kill what still runs inside the namespaces, then delete namespaces, veths and bridges. Idempotent."""
        if self._closed:
            return
        for forwarder in self._forwarders:
            forwarder.kill()
            forwarder.wait()
        self._forwarders = []
        for ns in self._namespaces:  # a live process would keep its namespace alive, unnamed, after `netns del`
            for pid in _run(["ip", "netns", "pids", ns], check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for i in range(self.size):
            _run(["ip", "link", "del", self._veth(i)], check=False)  # deletes both ends, synchronously
        for ns in self._namespaces:
            _run(["ip", "netns", "del", ns], check=False)
        for bridge in self._bridges:
            _run(["ip", "link", "del", bridge], check=False)
        self._namespaces, self._bridges = [], []
        self._closed = True  # last: a close interrupted half-way is finished by the atexit call
        atexit.unregister(self.close)

    def _index(self, i: int) -> int:
        if not 0 <= i < self.size:
            raise IndexError(f"namespace index {i} is not in 0..{self.size - 1}")
        return i

    def _veth(self, i: int) -> str:
        """The host end of namespace ``i``'s link: a veth (whose other end is ``eth0`` inside the namespace),
        or with delay or loss the TAP device on the bridge that its forwarder serves."""
        return f"{PREFIX}{self.tag}h{self._index(i)}"

    def _add_bridge(self, name: str) -> None:
        _run(["ip", "link", "add", "name", name, "type", "bridge"])
        self._bridges.append(name)
        # a fixed MAC: by default a bridge takes its ports' lowest MAC, which changes when partition() moves
        # ports, and the namespaces' ARP entries for host_ip would go stale
        mac = "02:" + ":".join(f"{b:02x}" for b in secrets.token_bytes(5))
        _run(["ip", "link", "set", name, "address", mac, "up"])

    def _create(self) -> None:
        self._add_bridge(self.bridge)
        _run(["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge])
        for i in range(self.size):
            ns, veth = self._edge(i), self._veth(i)
            _run(["ip", "netns", "add", ns])
            self._namespaces.append(ns)
            if self.emulated:
                _run(["ip", "tuntap", "add", "dev", veth, "mode", "tap"])
                _run(["ip", "-n", ns, "tuntap", "add", "dev", "eth0", "mode", "tap"])
                mtu = str(tap_mtu(self.rate_mbit, self.delay_ms))
                _run(["ip", "link", "set", veth, "mtu", mtu])
                _run(["ip", "-n", ns, "link", "set", "eth0", "mtu", mtu])
                self._start_forwarder(i)
            else:
                _run(["ip", "link", "add", "name", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.public_ip(i)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            # TCP windows up to 32 MB, as on hosts tuned for long fat links (a 1 Gbit/s, 100 ms path holds
            # 12.5 MB in flight; the defaults, 4-6 MB, would cap it near 300 Mbit/s)
            tuned = [("tcp_rmem", "4096 131072 33554432"), ("tcp_wmem", "4096 16384 33554432")]
            if self.notsent_lowat is not None:
                tuned.append(("tcp_notsent_lowat", str(self.notsent_lowat)))
            for name, value in tuned:
                _run(["ip", "netns", "exec", ns, "sh", "-c", f"echo '{value}' > /proc/sys/net/ipv4/{name}"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            if self.rate_mbit is not None:
                self._shape(i)
            if i in self.behind_nat:
                self._add_home(i)

    def _add_home(self, i: int) -> None:
        """Put namespace ``i`` behind a NAT router, the way a home machine sits behind its router.

        The edge namespace becomes the router: it forwards and masquerades what the home namespace sends
        out of its ``eth0``, and lets in only replies (conntrack). Nothing outside can open a connection
        to the home namespace: it has a private address that no one has a route to.
        """
        router, home = self._edge(i), self.namespace(i)
        _run(["ip", "netns", "add", home])
        self._namespaces.append(home)
        _run(["ip", "-n", router, "link", "add", "name", "lan0", "type", "veth", "peer", "name", "eth0",
              "netns", home])
        _run(["ip", "-n", router, "addr", "add", f"192.168.{i + 1}.1/24", "dev", "lan0"])
        _run(["ip", "-n", router, "link", "set", "lan0", "up"])
        _run(["ip", "-n", home, "addr", "add", f"{self.ip(i)}/24", "dev", "eth0"])
        _run(["ip", "-n", home, "link", "set", "lo", "up"])
        _run(["ip", "-n", home, "link", "set", "eth0", "up"])
        _run(["ip", "-n", home, "route", "add", "default", "via", f"192.168.{i + 1}.1"])
        _run(["ip", "netns", "exec", router, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
        _run(["ip", "netns", "exec", router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "eth0",
              "-j", "MASQUERADE"])

    def _start_forwarder(self, i: int) -> None:
        """Join namespace ``i``'s two TAP devices with a forwarder holding half the delay and loss each way."""
        link_loss = 1 - (1 - self.loss) ** 0.5
        forwarder = subprocess.Popen(
            [sys.executable, "-m", "docker.forwarder", "--host-tap", self._veth(i), "--namespace", self._edge(i),
             "--delay-ms", f"{self.delay_ms / 2:g}", "--loss", f"{link_loss:.6g}", "--seed", str(i)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
        self._forwarders.append(forwarder)
        ready, _, _ = select.select([forwarder.stdout], [], [], READY_SECONDS)
        if not ready or forwarder.stdout.readline().strip() != b"ready":
            forwarder.kill()
            raise RuntimeError(f"the forwarder of {self.namespace(i)} did not start: "
                               f"{forwarder.stderr.read().decode(errors='replace').strip()[-500:]}")

    def _shape(self, i: int) -> None:
        """tbf at ``rate_mbit`` on both ends of namespace ``i``'s veth: each shapes what it sends."""
        # burst: at least one 64 KiB GSO packet, so tbf forwards TCP's segmentation-offload bursts whole
        # instead of splitting them, and at least 1 ms of traffic, so a high rate needs no timer per packet.
        # latency: the queue holds 50 ms at the rate, enough for TCP to keep the link busy and little enough
        # not to add a standing delay that would eat into hivemind's request timeouts.
        burst = max(64 * 1024, int(self.rate_mbit * 1e6 / 8 / 1000))
        tbf = ["root", "tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", str(burst), "latency", f"{LATENCY_MS}ms"]
        _run(["tc", "qdisc", "add", "dev", self._veth(i), *tbf])  # bridge -> namespace
        _run(["tc", "-n", self._edge(i), "qdisc", "add", "dev", "eth0", *tbf])  # namespace -> bridge


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m docker.netns", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4, help="namespaces to create, one per peer (default 4)")
    parser.add_argument("--rate-mbit", type=float, default=None, help="shape each peer's link, each way (Mbit/s)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay between two peers (ms)")
    parser.add_argument("--loss", type=float, default=0.0, help="chance a packet between two peers is lost")
    parser.add_argument("--behind-nat", type=int, nargs="*", default=(), metavar="I",
                        help="put these namespaces behind a NAT router (their peers need --client-mode)")
    args = parser.parse_args(argv)
    ok, reason = available()
    if not ok:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    for sig in (signal.SIGINT, signal.SIGTERM):  # both end the wait, also when started with SIGINT ignored (`&`)
        signal.signal(sig, signal.default_int_handler)
    net = None
    try:
        net = TestNetwork(args.peers, args.rate_mbit, args.delay_ms, args.loss, tuple(args.behind_nat))
        python = sys.executable  # the interpreter that has this project installed, also under sudo
        lines = [f"bootstrap {net.host_ip} {python} -m dht --host-maddrs /ip4/{net.host_ip}/tcp/0"]
        for i in range(net.size):
            nat = ["--client-mode"] if i in net.behind_nat else []
            command = net.wrap(i, [python, "-m", "peer", "--host-maddrs", f"/ip4/{net.ip(i)}/tcp/31337", *nat])
            lines.append(f"{net.namespace(i)} {net.ip(i)} {shlex.join(command)} --new-run "
                         f"--initial-peers <bootstrap multiaddr>")
        shaped = f"{args.rate_mbit:g} Mbit/s each way per peer" if args.rate_mbit else "no rate limit"
        if net.emulated:
            shaped += f", {args.delay_ms:g} ms one way and {args.loss:g} loss between two peers"
        lines.append(f"{shaped}; Ctrl+C or SIGTERM removes the network")
        print("\n".join(lines), flush=True)
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # let the cleanup finish
            signal.signal(sig, signal.SIG_IGN)
        if net is not None:
            net.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
