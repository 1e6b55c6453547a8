"""Where a machine's CPU goes while a swarm runs on it: peers' training, their DHT processes, their p2p daemons.

    python -m bench.cpu_share --skip 60 -- python -m bench.goodput --peers 16 --minutes 4 --systems swarm \\
        --schedules none --inner-steps 40 --min-step-seconds 1 --slow-every 4 --slow-step-seconds 6 \\
        --batch-size 4 -- --model micro --threads 1 --seq-len 64

runs the command and, every ``--every`` seconds until it exits, reads every process's CPU time from ``/proc``
(Linux) and adds the change to one of:

- ``peer``: a ``python -m peer`` process itself (training, the sync's decisions, the outer step);
- ``dht``: a peer's forked child that runs a p2p daemon of its own (hivemind's DHT process);
- ``averager``: a peer's other forked Python children (the averager process: matchmaking, the all-reduce);
- ``p2pd``: the p2p daemons (every peer has two: its DHT's and its averager's);
- ``other``: the rest of the machine (the driver, the bootstrap node, the system).

It prints the median CPU-seconds per interval of each, past the first ``--skip`` seconds (startup), and the
median load average: on 2 cores, 2 CPU-seconds a second is all there is.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, Tuple

KINDS = ("peer", "dht", "averager", "p2pd", "other")
Process = Tuple[int, float, str, str]  # parent pid, CPU seconds, command line, name


def processes() -> Dict[int, Process]:
    ticks, found = os.sysconf("SC_CLK_TCK"), {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat, open(f"/proc/{name}/cmdline") as cmdline:
                text, command = stat.read(), cmdline.read().replace("\0", " ")
        except OSError:  # it exited meanwhile
            continue
        fields = text.rsplit(")", 1)[1].split()
        found[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks, command,
                            text.split("(", 1)[1].rsplit(")", 1)[0])
    return found


def kind_of(pid: int, table: Dict[int, Process]) -> str:
    parent, _, command, name = table[pid]
    if "p2pd" in name:
        return "p2pd"
    is_peer = lambda p: p in table and " -m peer" in table[p][2]  # noqa: E731
    if is_peer(pid) and not is_peer(parent):
        return "peer"
    if is_peer(parent) and not is_peer(table[parent][0]) and name.startswith("python"):
        has_daemon = any(p[0] == pid and "p2pd" in p[3] for p in table.values())
        return "dht" if has_daemon else "averager"
    return "other"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_share", description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--skip", type=float, default=60.0, help="seconds of startup left out of the medians")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    child, began = subprocess.Popen(command), time.monotonic()
    before, samples, loads = processes(), collections.defaultdict(list), []
    while child.poll() is None:
        time.sleep(args.every)
        now = processes()
        spent = collections.Counter()
        for pid in now:
            spent[kind_of(pid, now)] += now[pid][1] - (before[pid][1] if pid in before else 0.0)
        before = now
        if time.monotonic() - began >= args.skip:
            for kind in KINDS:
                samples[kind].append(spent[kind])
            loads.append(os.getloadavg()[0])
    if not loads:
        print("error: the command ended before --skip seconds; nothing measured", file=sys.stderr)
        return 1
    print(f"\nCPU-seconds per {args.every:g} s (median of {len(loads)} samples; the machine has "
          f"{os.cpu_count()} cores), load average {statistics.median(loads):.1f}:")
    print("| " + " | ".join(KINDS) + " |\n|" + "---|" * len(KINDS))
    print("| " + " | ".join(f"{statistics.median(samples[kind]):.1f}" for kind in KINDS) + " |")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
