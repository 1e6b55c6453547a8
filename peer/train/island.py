"""An island: one peer made of several processes under torchrun, data-parallel inside, one voice outside.

    torchrun --nproc-per-node 8 -m peer --initial-peers /ip4/.../p2p/...

Every rank trains the same model with DistributedDataParallel (NCCL on GPUs, gloo on CPUs) on its own
slice of the island's data: each step the island reads ``size`` batches from its shard and rank r takes
the r-th. Rank 0 is the peer: only it joins the DHT, matches, averages with the swarm and checkpoints.
The others follow its commands, one per inner step, in lockstep (every collective is issued by the
training thread of each rank, in the same order):

- ``STEP(lr)``: every rank takes one inner step; DDP averages the gradients across the island.
  When the swarm changed rank 0's model since the last step (an outer step, a rebase, a downloaded
  state, aligned moments, a restored checkpoint), rank 0 first broadcasts theta and AdamW's state, so
  the ranks never diverge.
- ``TOKENS``: the ranks sum the tokens they trained on this round: the island's weight in the swarm.
- ``CHECK``: every rank hashes its parameters; rank 0 reports the hashes (all equal) in its metrics.
- ``STOP``: rank 0 is leaving (Ctrl+C, --max-rounds); the others exit.

A rank that dies breaks the island's next collective. Rank 0 then checkpoints, tells the swarm it left
and exits with one line; torchrun stops the other ranks, and a restart with the same --checkpoint-dir
resumes the island under the same peer id.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

import torch
import torch.distributed as dist

from dht.errors import UserError, first_line
from peer.train.data import batch_iterator

STEP, TOKENS, CHECK, STOP = range(4)


class IslandLost(UserError):
    """Another rank of this island is gone: the island stops (rank 0 checkpoints first)."""


@dataclass
class Command:
    kind: int
    lr: float = 0.0
    with_state: bool = False
    with_moments: bool = False
    adam_step: float = 0.0


class Island:
    """This process's place in its island, and the collectives rank 0 drives."""

    def __init__(self, rank: int, size: int, local_rank: int, device: torch.device):
        self.rank, self.size, self.local_rank, self.device = rank, size, local_rank, device
        self.leader = rank == 0
        self.following = False  # rank 0: the other ranks have entered their command loop
        self.broken = False
        self.blocked_since: Optional[float] = None  # when the collective in progress began (only another rank ends it)

    @classmethod
    def from_env(cls, device_flag: str, timeout_seconds: float = 1800.0) -> Optional["Island"]:
        """Join the island torchrun started this process in; None for a plain single-process peer."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return None
        rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        if device_flag == "auto":
            device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(device_flag)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_seconds))
        except Exception as e:  # a rendezvous that fails: torchrun's store gone, a port taken
            raise UserError(f"could not form the island (rank {rank} of {size}): {first_line(e)}") from None
        return cls(rank, size, local_rank, device)

    # ------------------------------------------------------------------ collectives
    @contextlib.contextmanager
    def guard(self):
        """Turn a failed collective (a rank died or froze past the timeout) into one line."""
        self.blocked_since = time.monotonic()
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            if not dist.is_initialized():
                raise
            self.broken = True
            who = "rank 0 (the island's peer) is gone" if not self.leader else "another rank of this island is gone"
            raise IslandLost(f"{who}: {first_line(e)}; the island stops (restart torchrun with the same "
                             f"--checkpoint-dir to resume it)") from None
        finally:
            self.blocked_since = None

    def blocked_for(self) -> float:
        """Seconds this rank's training thread has been in a collective (0 in none): what a stop watches, since only
        the other ranks end one (``peer/round/stopping.py``)."""
        since = self.blocked_since
        return 0.0 if since is None else time.monotonic() - since

    def _tensor(self, values: List[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64, device=self.device)

    def share(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a pickled broadcast, for set-up only)."""
        box = [obj]
        with self.guard():
            dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def command(self, command: Optional[Command] = None) -> Command:
        """Rank 0 sends ``command``; every other rank receives it."""
        values = self._tensor([0.0] * 5 if command is None else [
            command.kind, command.lr, command.with_state, command.with_moments, command.adam_step])
        with self.guard():
            dist.broadcast(values, src=0)
        kind, lr, with_state, with_moments, adam_step = values.tolist()
        return Command(int(kind), lr, bool(with_state), bool(with_moments), adam_step)

    def sync_model(self, trainer, command: Command) -> None:
        """Rank 0's theta (and AdamW state, once it has one) onto every rank, in place."""
        with self.guard(), torch.no_grad():
            for param in trainer.params:
                dist.broadcast(param.data, src=0)
            if command.with_moments:
                for param in trainer.params:
                    state = trainer.adam_state(param, command.adam_step)
                    dist.broadcast(state["exp_avg"], src=0)
                    dist.broadcast(state["exp_avg_sq"], src=0)

    def sum_tokens(self, tokens: int) -> List[int]:
        """Every rank's token count this round, in rank order (their sum is the island's weight)."""
        counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        with self.guard():
            dist.all_gather(counts, torch.tensor([tokens], dtype=torch.int64, device=self.device))
        return [int(c.item()) for c in counts]

    def parameter_hashes(self, trainer) -> List[str]:
        """Every rank's hash of its parameters, in rank order."""
        digest = hashlib.sha256()
        for param in trainer.params:
            digest.update(param.detach().float().cpu().contiguous().numpy().tobytes())
        hashes: List[Optional[str]] = [None] * self.size
        with self.guard():
            dist.all_gather_object(hashes, digest.hexdigest()[:16])
        return hashes

    # ------------------------------------------------------------------ rank 0
    def before_step(self, trainer, lr: float) -> None:
        """Rank 0, before each inner step: every rank steps with ``lr``, from rank 0's model if it changed."""
        self.following = True
        command = self._with_state(Command(STEP, lr), trainer)
        self.command(command)
        if command.with_state:
            self.sync_model(trainer, command)

    def end_round(self, tokens: int) -> List[int]:
        """Rank 0, after an inner phase: the ranks' token counts."""
        self.command(Command(TOKENS))
        return self.sum_tokens(tokens)

    def check(self, trainer) -> List[str]:
        """Rank 0, after a round's sync: bring the ranks up to date, then their parameter hashes."""
        command = self._with_state(Command(CHECK), trainer)
        self.command(command)
        if command.with_state:
            self.sync_model(trainer, command)
        return self.parameter_hashes(trainer)

    def _with_state(self, command: Command, trainer) -> Command:
        if trainer.changed:
            command.with_state = True
            step = trainer.adam_step()
            command.with_moments, command.adam_step = step is not None, step or 0.0
            trainer.changed = False
        return command

    def close(self) -> None:
        """Rank 0 on its way out: release the other ranks (unless one is already gone)."""
        if dist.is_initialized():
            if self.leader and not self.broken:
                with contextlib.suppress(UserError):
                    if self.following:
                        self.command(Command(STOP))
                    else:
                        self.share(None)  # they wait for the run's settings: there will be none
            dist.destroy_process_group()

    # ------------------------------------------------------------------ the other ranks
    def follow(self, trainer, batches: Iterator[torch.Tensor]) -> None:
        """Ranks 1..n-1: do what rank 0 says until it says stop."""
        tokens = 0
        while True:
            command = self.command()
            if command.with_state:
                self.sync_model(trainer, command)
            if command.kind == STEP:
                batch = next(batches)
                with self.guard():
                    trainer.step(batch, command.lr)
                tokens += batch.numel()
            elif command.kind == TOKENS:
                self.sum_tokens(tokens)
                tokens = 0
            elif command.kind == CHECK:
                self.parameter_hashes(trainer)
            elif command.kind == STOP:
                return
            else:
                raise IslandLost(f"rank 0 sent an unknown command {command.kind}: mismatched peer versions?")


def island_batches(stream, batch_size: int, island: Optional[Island]) -> Iterator[torch.Tensor]:
    """This rank's batches: the island reads ``size`` batches per step from its shard, rank r takes the r-th."""
    if island is None:
        return batch_iterator(stream, batch_size)
    return (rows[island.rank * batch_size : (island.rank + 1) * batch_size]
            for rows in batch_iterator(stream, batch_size * island.size))
