"""Where an all-reduce's time goes on a thin link: the peer's exact all-reduce against plain TCP, same bytes.

    python -m bench.link_allreduce --rate-mbit 1 --delay-ms 100 --values 2800000 --codec int4-huffman

The hard row (``bench/results/wan.md``) found a fragment's all-reduce taking about 3.7 times as long as its bytes
need at the link's rate, with the peers training beside it. This takes training away: N namespaces on one
``docker.netns.TestNetwork`` link (tbf for the rate, the user-space forwarder for the delay), and in each:

- ``tcp``: every worker sends every other worker B bytes at once over plain sockets (B: what one member sends each
  other member in the all-reduce below, both phases), so the link, its queues and TCP alone set the time;
- ``allreduce``: a DHT node and the peer's ``SwarmAverager`` (the exact butterfly, the codec, hivemind's streams
  through the p2p daemon), running ``--rounds`` all-reduces of ``--values`` random values;

and reports, per mode, the slowest member's seconds against the bytes' time at the link's rate. The all-reduce runs
once per ``--part-sizes`` (nominal encoded bytes a part: the fixed 1 MiB before ``parts.part_bytes``, and 0 for
the peer's own choice), all on one network; the TCP mode sends what the last of them sent.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List

from tests.harness.swarm import Proc, Swarm, wait_until

CHUNK = 64 * 1024
PORT = 7070


def tcp_worker(args) -> None:
    """Serve on PORT, then at ``--start`` send ``--bytes`` to every other worker at once; print the seconds until
    every send and every receive finished."""
    server = socket.create_server((args.ips[args.index], PORT), backlog=len(args.ips))
    received: List[float] = []

    def receive(conn: socket.socket) -> None:
        left = args.bytes
        while left > 0:
            data = conn.recv(min(CHUNK, left))
            if not data:
                break
            left -= len(data)
        received.append(time.time())
        conn.close()

    def accept() -> None:
        threads = []
        for _ in range(len(args.ips) - 1):
            conn, _ = server.accept()
            threads.append(threading.Thread(target=receive, args=(conn,)))
            threads[-1].start()
        for thread in threads:
            thread.join()

    sent: List[float] = []

    def send(ip: str) -> None:
        with socket.create_connection((ip, PORT), timeout=600) as conn:
            conn.sendall(bytes(args.bytes))
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)  # the receiver closes once it has everything
        sent.append(time.time())

    acceptor = threading.Thread(target=accept)
    acceptor.start()
    time.sleep(max(0.0, args.start - time.time()))
    senders = [threading.Thread(target=send, args=(ip,)) for i, ip in enumerate(args.ips) if i != args.index]
    for thread in senders:
        thread.start()
    for thread in senders + [acceptor]:
        thread.join()
    print(json.dumps(dict(seconds=max(sent + received) - args.start, sent=args.bytes * len(senders))), flush=True)


def allreduce_worker(args) -> None:
    import torch
    from diloco_compression import get_codec
    from hivemind.utils import get_dht_time

    from dht.node import DHTConfig, start_dht
    from peer.averaging.averager import SwarmAverager

    ip = args.ips[args.index]
    dht = start_dht(DHTConfig(host_maddrs=(f"/ip4/{ip}/tcp/0",), initial_peers=(args.initial_peers,)))
    averager = SwarmAverager(
        torch.zeros(args.values), None, dht, prefix="link", codec=get_codec(args.codec),
        state_provider=lambda: ({}, []), quorum=1, grace_seconds=5.0, request_timeout=5.0,
        allreduce_timeout=600.0, part_timeout=args.part_timeout, client_mode=False,
        part_size_bytes=args.part_size_bytes or None,
    )
    averager.run_in_background(await_ready=True)
    generator = torch.Generator().manual_seed(args.index)
    for epoch in range(args.rounds):
        with averager.get_tensors() as (delta,):
            delta.copy_(torch.randn(args.values, generator=generator))
        averager.prepare_round(epoch, "cafe", min_group=len(args.ips), expected_group=len(args.ips),
                               allreduce_timeout=600.0, part_timeout=args.part_timeout)
        before = averager.traffic()
        start = args.start + epoch * args.period
        wait = max(1.0, start - time.time())
        control = averager.step(gather=dict(epoch=epoch, hash="cafe", tokens=1, align=False), weight=1.0,
                                scheduled_time=get_dht_time() + wait, timeout=wait + 60.0,
                                allow_retries=False, wait=False)
        outcome = control.result(timeout=900)
        after = averager.traffic()
        print(json.dumps(dict(epoch=epoch, seconds=outcome.seconds, members=len(outcome.gathered),
                              sent=after[0] - before[0], received=after[1] - before[1])), flush=True)
    # until the driver stops us: a member that leaves when its own outputs are in may still owe the others its
    # averaged part
    threading.Event().wait()


def records(proc: Proc) -> List[dict]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def run_mode(mode: str, net, swarm: Swarm, args, log_dir: Path, per_pair: int = 0, part_size: int = 0
             ) -> List[List[dict]]:
    ips = [net.ip(i) for i in range(args.peers)]
    start = time.time() + (5 if mode == "tcp" else 20)
    common = ["--ips", *ips, "--start", f"{start:.3f}"]
    if mode == "tcp":
        extra = ["--bytes", str(per_pair)]
    else:
        extra = ["--initial-peers", swarm.maddr, "--values", str(args.values), "--codec", args.codec,
                 "--rounds", str(args.rounds), "--period", str(args.period),
                 "--part-size-bytes", str(part_size), "--part-timeout", str(args.part_timeout)]
    name = mode if mode == "tcp" else f"{mode}-{part_size}-"
    workers = [swarm.track(Proc([sys.executable, "-m", "bench.link_allreduce", mode, "--index", str(i), *common,
                                 *extra], log_dir, f"{name}{i}", lambda argv, i=i: net.wrap(i, argv)))
               for i in range(args.peers)]
    need = 1 if mode == "tcp" else args.rounds
    wait_until(lambda: all(len(records(w)) >= need for w in workers) or any(w.popen.poll() not in (None, 0)
                                                                             for w in workers),
               args.rounds * args.period + 900, f"{mode} workers")
    failed = [w for w in workers if len(records(w)) < need]
    if failed:
        raise SystemExit(f"{failed[0].name} failed:\n{failed[0].stderr[-2000:]}")
    for worker in workers:
        worker.kill_group()
    return [records(w) for w in workers]


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] in ("tcp", "allreduce"):
        parser = argparse.ArgumentParser()
        parser.add_argument("mode")
        parser.add_argument("--index", type=int, required=True)
        parser.add_argument("--ips", nargs="+", required=True)
        parser.add_argument("--start", type=float, required=True)
        parser.add_argument("--bytes", type=int, default=0)
        parser.add_argument("--initial-peers", default="")
        parser.add_argument("--values", type=int, default=0)
        parser.add_argument("--codec", default="int4-huffman")
        parser.add_argument("--rounds", type=int, default=1)
        parser.add_argument("--period", type=float, default=60.0)
        parser.add_argument("--part-size-bytes", type=int, default=0)
        parser.add_argument("--part-timeout", type=float, default=300.0)
        args = parser.parse_args(argv)
        (tcp_worker if args.mode == "tcp" else allreduce_worker)(args)
        return 0

    from docker.netns import TestNetwork

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate-mbit", type=float, default=1.0, help="each way (0: unshaped veths)")
    parser.add_argument("--delay-ms", type=float, default=100.0)
    parser.add_argument("--values", type=int, default=2_800_000, help="values a member averages (a fragment)")
    parser.add_argument("--codec", default="int4-huffman")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--period", type=float, default=90.0, help="seconds between the rounds' planned starts")
    parser.add_argument("--part-sizes", default="1048576,0",
                        help="comma-separated part sizes in bytes, one all-reduce run each; 0: the peer's own "
                             "(parts.part_bytes); 1048576: the fixed size before it")
    parser.add_argument("--part-timeout", type=float, default=300.0,
                        help="the peer's --part-timeout: most seconds a member waits for a groupmate's next part")
    args = parser.parse_args(argv)
    part_sizes = [int(size) for size in args.part_sizes.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="link_allreduce_"))
    with TestNetwork(args.peers, rate_mbit=args.rate_mbit or None, delay_ms=args.delay_ms) as net:
        swarm = Swarm(log_dir, net)
        try:
            results = {f"allreduce, parts {size or 'sized per round'}": run_mode("allreduce", net, swarm, args,
                                                                                  log_dir, part_size=size)
                       for size in part_sizes}
            # what one member sends each other member in one all-reduce, both phases, in the last part size's run
            reduced = list(results.values())[-1]
            per_pair = int(statistics.median(r["sent"] for rows in reduced for r in rows) / (args.peers - 1))
            results["tcp, the same bytes"] = run_mode("tcp", net, swarm, args, log_dir, per_pair)
        finally:
            swarm.close()
    rate = args.rate_mbit * 1e6 / 8
    link = f"{args.rate_mbit:g} Mbit/s each way" if rate else "unshaped"
    print(f"{args.peers} members, {link}, {args.delay_ms:g} ms RTT, {args.values:,} values, {args.codec}; "
          f"logs: {log_dir}\n")
    print("| mode | runs | MB sent a member | seconds (slowest member, median of runs) | bytes' time at the rate s "
          "| ratio |")
    print("|---|---|---|---|---|---|")
    for mode, rows in results.items():
        runs = list(zip(*rows))  # one tuple of members' records per run
        seconds = statistics.median(max(r["seconds"] for r in run) for run in runs)
        sent = statistics.median(max(r["sent"] for r in run) for run in runs)
        ideal = f"{sent / rate:.1f} | {seconds / (sent / rate):.2f}" if rate else "- | -"
        print(f"| {mode} | {len(runs)} | {sent / 1e6:.2f} | {seconds:.1f} | {ideal} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
