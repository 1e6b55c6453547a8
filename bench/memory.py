"""Peak memory of a peer against plain single-process AdamW training of the same model.

    python -m bench.memory --model small --steps 20 [--device cuda]

runs, one after the other on this machine:

- ``plain``: the model and its AdamW in one process, ``--steps`` steps of the peer's own inner loop
  (peer/train/inner.py) on the bundled data, and nothing else;
- ``peer``: ``python -m peer`` alone for 2 rounds of ``--steps / 2`` steps: the same inner loop, plus the
  outer state (G, outer momentum, the error-feedback residual, the shared pseudo-gradient and moment
  buffers), the DHT and the averager process.

It reports each training process's own peak (peak allocated GPU memory with ``--device cuda``, else peak
RSS), and for the peer the peak of its whole process tree in PSS (shared pages split among the processes
that map them, so the shared buffers count once). The outer state is fp32 in CPU memory by design: on a GPU
the peer's accelerator peak should equal plain training's, and on a CPU the difference is that state.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional

MB = 1 << 20


def tree_pss(pid: int) -> int:
    """PSS bytes of ``pid`` and all its descendants, now."""
    from tests.harness.swarm import descendants

    total = 0
    for member in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{member}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass
    return total


class PeakSampler:
    """The peak of ``tree_pss(pid)``, sampled every 0.2 s on a thread until ``stop``."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._done = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.2):
            self.peak = max(self.peak, tree_pss(self.pid))

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def plain(model: str, steps: int, device: str, threads: int) -> dict:
    """Plain AdamW training in this process: the peer's inner loop, without any of the swarm's state."""
    import torch

    from peer.config import NodeConfig, RunConfig
    from peer.train.build import build_trainer
    from peer.train.data import batch_iterator

    torch.set_num_threads(threads)
    run = RunConfig.from_settings(RunConfig(model=model).to_settings())
    corpus, trainer = build_trainer(run, NodeConfig(device=device))
    stream = corpus.stream(run.seed, "plain", 0)
    stats = trainer.train(batch_iterator(stream, run.batch_size), steps, 0)
    return dict(peak=trainer.peak_memory(), device=str(trainer.device), loss=stats.loss,
                parameters=sum(p.numel() for p in trainer.params))


def run_plain(args) -> dict:
    command = [sys.executable, "-m", "bench.memory", "--plain", "--model", args.model, "--steps", str(args.steps),
               "--device", args.device, "--threads", str(args.threads)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run_peer(args, log_dir: Path) -> dict:
    from tests.harness.swarm import PeerProc

    rounds = 2
    peer = PeerProc(["--model", args.model, "--inner-steps", str(args.steps // rounds), "--max-rounds", str(rounds),
                     "--quiet", "--threads", str(args.threads), "--device", args.device, "--run-id", "memory",
                     "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], log_dir, "peer")
    sampler = PeakSampler(peer.popen.pid)
    try:
        if peer.wait(3600) != 0:
            raise SystemExit(f"the peer failed:\n{peer.stderr[-2000:]}")
    finally:
        tree = sampler.stop()
        peer.kill_group()
    last = peer.metrics[-1]
    return dict(peak=last["peak_memory_bytes"], device=last["device"], tree=tree, loss=last["loss"])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # the baseline's own process
    args = parser.parse_args(argv)
    if args.plain:
        print(json.dumps(plain(args.model, args.steps, args.device, args.threads)))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    log_dir = Path(tempfile.mkdtemp(prefix="memory_"))
    started = time.monotonic()
    base = run_plain(args)
    peer = run_peer(args, log_dir)
    n = base["parameters"]
    unit = "GPU allocated" if base["device"].startswith("cuda") else "RSS"
    print(f"{args.model}: {n / 1e6:.1f}M parameters on {base['device']}, {args.steps} steps "
          f"({time.monotonic() - started:.0f} s)\n")
    print(f"| process | peak {unit} MiB | ratio to plain | whole process tree, PSS MiB |")
    print("|---|---|---|---|")
    print(f"| plain AdamW | {base['peak'] / MB:.0f} | 1.00 | - |")
    print(f"| peer | {peer['peak'] / MB:.0f} | {peer['peak'] / base['peak']:.2f} | {peer['tree'] / MB:.0f} |")
    print(f"\nfp32 model-sized vectors ({4 * n / MB:.0f} MiB each): the peer's outer state holds G, the outer momentum "
          f"and the error-feedback residual, plus the shared pseudo-gradient and moment buffers: 5 of them, "
          f"{5 * 4 * n / MB:.0f} MiB, all in CPU memory.")
    print(f"metrics and logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
