"""Configuration: what a run shares (the manifest) and what each node chooses for itself.

``RunConfig`` fields travel in the run manifest, so a joiner needs only ``--initial-peers``; a flag
given explicitly that disagrees with the manifest is refused. ``None`` means "the preset's default"
and is filled in by ``RunConfig.resolved()`` before the manifest is written.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

from diloco_compression import CODECS

from dht.cli import opt, require_non_negative, require_positive, typed_values
from peer.outer.schedule import cosine_factor, portable_cos
from peer.presets import PRESETS, run_defaults

# the default outer warm-up: this over the square root of H, in outer steps (fitted to the sweeps' best lengths of those
# tried: 32 at H = 10, 16 at 50, 8 at 100; docs/design.md, the outer step)
OUTER_WARMUP_SCALE = 100.0
# the default outer momentum: 1 - m = this x (10 / H)^2, between 0.1 and 0.5 (fitted to the sweeps' best of those
# tried: 0.5 at H = 2 and 3, 0.6 at 5, 0.8 at 7, 0.9-0.95 at 10; bench/results/convergence-warmup-h10.md)
OUTER_MOMENTUM_FORGET = 0.1


@dataclass(frozen=True)
class RunConfig:
    """Settings every peer of a run shares; they form the run manifest."""

    model: str = opt("tiny", f"a preset ({', '.join(PRESETS)}), a Hugging Face causal LM's directory, or its hub "
                             f"name (org/name)")
    init_from_pretrained: bool = opt(False, "start from the Hugging Face model's weights instead of a fresh "
                                            "initialisation from its config (seeded by --seed)")
    revision: Optional[str] = opt(None, "the hub revision (branch, tag or commit) of a hub --model; the manifest "
                                        "pins its commit")
    tokenizer: Optional[str] = opt(None, "bytes, gpt2, or a Hugging Face tokenizer's directory or hub name; "
                                         "default: the preset's, or a Hugging Face model's own")
    dataset: str = opt("shakespeare", "'shakespeare' (bundled), a folder of .txt files, or a Hugging Face name")
    dataset_config: Optional[str] = opt(None, "Hugging Face dataset configuration name, e.g. en for c4")
    text_field: str = opt("text", "field that holds the text in a Hugging Face dataset")
    seq_len: Optional[int] = opt(None, "tokens per training sequence; default: the preset's")
    batch_size: Optional[int] = opt(None, "sequences per inner step on each peer; default: the preset's")
    inner_steps: Optional[int] = opt(None, "H: inner steps between two averagings of each parameter; default: the "
                                           "preset's")
    fragments: int = opt(1, "F: cut the model into F fragments averaged on staggered schedules: a round is H/F inner "
                            "steps and averages one fragment, so each round sends 1/F of the model (Streaming DiLoCo)")
    round_seconds: float = opt(0.0, "if > 0, H is this many seconds of compute instead of a number of steps (a round "
                                    "is this / F with fragments)")
    lr: Optional[float] = opt(None, "peak inner AdamW learning rate; default: the preset's")
    warmup_steps: Optional[int] = opt(None, "inner steps of linear warmup on a fresh optimizer")
    lr_decay_steps: int = opt(20000, "global inner steps (epoch x H) of cosine decay to --min-lr-ratio")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of --lr")
    weight_decay: float = opt(0.1, "AdamW weight decay")
    grad_clip: float = opt(1.0, "clip the inner gradient norm to this (0 = off)")
    outer_lr: float = opt(0.7, "outer Nesterov learning rate (DiLoCo: 0.7)")
    outer_momentum: Optional[float] = opt(None, "outer Nesterov momentum; default: DiLoCo's 0.9 from H = 10 up, less "
                                                "below (1 - 10 / H^2, at least 0.5: 0.6 at H = 5)")
    outer_lr_decay: bool = opt(False, "decay the outer lr along the inner lr's cosine, to --outer-lr x --min-lr-ratio")
    outer_warmup: Optional[int] = opt(None, "outer steps over which the outer step blends linearly from plain "
                                            "averaging (lr 1, momentum 0) to Nesterov at --outer-lr and "
                                            "--outer-momentum (0 = Nesterov from the first); default: 100 / sqrt(H), "
                                            "rounded (32 at H = 10, 10 at 100)")
    compression: str = opt("int4-huffman", "wire codec for the all-reduce (int4-huffman: fp16's held-out loss at "
                                           "about 1/6 of its bytes)", choices=tuple(CODECS))
    error_feedback: bool = opt(True, "carry what the codec dropped from our delta into the next round")
    align_every: int = opt(0, "average the inner AdamW first moment every k rounds (0 = never: it cost a quarter more "
                              "bytes for no measured gain)")
    stale_discount: float = opt(0.5, "a contribution stale by k rounds weighs tokens x this^k in the average")
    max_staleness: int = opt(4, "rounds of unmerged work after which a peer drops it and resyncs")
    clip_factor: float = opt(4.0, "robust aggregation: clip each part's deviation from the median to this many "
                                  "median deviations, reject one 10 times as far (0 = plain weighted mean)")
    ban_after: int = opt(3, "ignore a peer's parts for the rest of the run after this many rounds with bad parts "
                            "(0 = never)")
    quorum: int = opt(1, "smallest group that may apply an outer step; 1 = a lone peer never blocks")
    group_size: int = opt(32, "split the peers at one state into groups of about this many (from 2.5 times this many "
                              "on: 3 groups), whose delegates then average across groups (0 = one group of all)")
    grace_seconds: float = opt(5.0, "matchmaking window: how long past the round's planned end a group waits for "
                                    "late peers")
    eval_fraction: float = opt(0.02, "tail of every text file held out for eval_loss (local datasets)")
    eval_batches: int = opt(8, "held-out batches per evaluation")
    eval_every: int = opt(5, "evaluate the global parameters every this many rounds (of H steps: F rounds each with "
                             "fragments)")
    seed: int = opt(0, "seed of the initial weights (and of each peer's data order)")
    # pins of a Hugging Face model and tokenizer, filled by the creator (``peer/train/source.py``)
    model_config: Optional[Dict[str, Any]] = opt(None, "the model's config.json, less volatile keys", cli=False)
    model_hash: Optional[str] = opt(None, "hash of model_config", cli=False)
    weights_hash: Optional[str] = opt(None, "hash of the weight files the run starts from", cli=False)
    tokenizer_hash: Optional[str] = opt(None, "hash of what the tokenizer does", cli=False)

    def __post_init__(self):
        if not self.model:
            raise ValueError("model must name a preset, a Hugging Face model directory or a hub name")
        require_positive(self, "seq_len", "batch_size", "inner_steps", "eval_batches", "eval_every", "quorum",
                         "fragments")
        if self.inner_steps is not None and self.inner_steps < self.fragments:
            raise ValueError(f"inner_steps must be at least fragments ({self.fragments}), got {self.inner_steps}")
        require_non_negative(self, "round_seconds", "weight_decay", "grad_clip", "align_every", "grace_seconds",
                             "clip_factor", "ban_after", "group_size",
                             "lr_decay_steps", "warmup_steps", "max_staleness", "outer_warmup")
        if self.lr is not None and not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr}")
        if self.group_size == 1:
            raise ValueError("group_size must be 0 (one group of all) or at least 2, got 1")
        if not 0 < self.outer_lr <= 10:
            raise ValueError(f"outer_lr must be in (0, 10], got {self.outer_lr}")
        if self.outer_momentum is not None and not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not 0 < self.eval_fraction < 0.5:
            raise ValueError(f"eval_fraction must be in (0, 0.5), got {self.eval_fraction}")
        if not 0 < self.stale_discount <= 1:
            raise ValueError(f"stale_discount must be in (0, 1], got {self.stale_discount}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    @property
    def h(self) -> int:
        """H: ``--inner-steps``, or the preset's."""
        return self.inner_steps or run_defaults(self.model).inner_steps

    @property
    def round_steps(self) -> int:
        """Inner steps per round: H, or H // F with fragments (each fragment is averaged every F x (H // F) steps, H
        rounded down to a multiple of F)."""
        return self.h // self.fragments

    @property
    def seconds_per_round(self) -> float:
        """With --round-seconds, a round's seconds of compute: each fragment is averaged every --round-seconds."""
        return self.round_seconds / self.fragments

    @property
    def eval_period(self) -> int:
        """Rounds between two held-out evaluations: --eval-every periods of H steps."""
        return self.eval_every * self.fragments

    def global_step(self, epoch: int) -> int:
        """The swarm's global inner step at the start of the round that closes ``epoch``: what the schedules follow.
        A fragment's outer steps come every F epochs, so ``global_step // H`` counts them."""
        return epoch * self.round_steps

    def lr_factor(self, global_step: int) -> float:
        """The inner lr's cosine decay at a global inner step (epoch x H) (``peer/outer/schedule.py``)."""
        return cosine_factor(global_step, self.lr_decay_steps, self.min_lr_ratio)

    def outer_lr_at(self, global_step: int) -> float:
        """The outer lr of the step that closes the round begun at ``global_step`` (``global_step(epoch)``): a
        function of the epoch alone, so every member of a group computes the same one (on every machine:
        ``portable_cos``)."""
        lr = self.outer_lr
        if self.outer_lr_decay:
            lr *= cosine_factor(global_step, self.lr_decay_steps, self.min_lr_ratio, portable_cos)
        blend = self._outer_blend(global_step)
        return lr if blend >= 1 else 1.0 + blend * (lr - 1.0)

    def outer_momentum_at(self, global_step: int) -> float:
        """The outer momentum of that step: ``outer_momentum_steady()``, ramped up from 0 over ``outer_warmup``
        steps."""
        return self.outer_momentum_steady() * self._outer_blend(global_step)

    def outer_momentum_steady(self) -> float:
        """``--outer-momentum``, or its default for this H: 1 - ``OUTER_MOMENTUM_FORGET`` x (10 / H)^2, between 0.5
        and 0.9, to two decimals (a small H's pseudo-gradients are small and many, and a long memory of them
        overshoots: 0.9 from H = 10 up, 0.8 at 7, 0.6 at 5, 0.5 below 5)."""
        if self.outer_momentum is not None:
            return self.outer_momentum
        return round(min(0.9, max(0.5, 1 - OUTER_MOMENTUM_FORGET * (10 / self.h) ** 2)), 2)

    def _outer_blend(self, global_step: int) -> float:
        """0 at the first outer step, 1 from step ``outer_warmup`` on (IEEE division of small integers: the same
        bits everywhere). With fragments, a fragment's own outer steps count: one every F rounds."""
        warmup = self.outer_warmup_steps()
        if not warmup:
            return 1.0
        return min(1.0, (global_step // max(self.round_steps, 1) // self.fragments) / warmup)

    def outer_warmup_steps(self) -> int:
        """``--outer-warmup``, or its default for this H: ``OUTER_WARMUP_SCALE / sqrt(H)`` outer steps, rounded (a
        small H warms up over more outer steps, and fewer inner ones: 32 at H = 10, 14 at 50, 10 at 100, 4 at 500)."""
        if self.outer_warmup is not None:
            return self.outer_warmup
        return max(1, round(OUTER_WARMUP_SCALE / math.sqrt(self.h)))

    def resolved(self) -> "RunConfig":
        """Fill every preset-dependent default, so the manifest pins concrete values."""
        preset = run_defaults(self.model)
        defaults = dict(
            tokenizer=preset.tokenizer or self.model, seq_len=preset.seq_len, batch_size=preset.batch_size,
            inner_steps=preset.inner_steps, lr=preset.lr, warmup_steps=preset.warmup_steps,
        )
        resolved = dataclasses.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})
        return dataclasses.replace(resolved, outer_warmup=resolved.outer_warmup_steps(),
                                   outer_momentum=resolved.outer_momentum_steady())

    def to_settings(self) -> Dict[str, Any]:
        return dataclasses.asdict(self.resolved())

    @classmethod
    def from_settings(cls, settings: Dict[str, Any]) -> "RunConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(settings) - names
        if unknown:
            raise ValueError(f"the run manifest has settings this version does not know: {sorted(unknown)}")
        # a stranger's manifest: a value of the wrong type is named here, not a traceback deep in training
        return cls(**typed_values(cls, settings, "the run manifest's"))


@dataclass(frozen=True)
class NodeConfig:
    """Choices each peer makes for itself."""

    config: Optional[str] = opt(None, "take flags from this TOML file, or a bundled one (tiny, home-150m, "
                                      "private-servers); flags typed on the command line win (peer/config_file.py)")
    run_id: str = opt("diloco", "name of the run to start or join")
    run_token: Optional[str] = opt(None, "a private run's shared secret (or set DILOCO_RUN_TOKEN): its keys derive "
                                         "from it, so peers without it cannot find or join the run")
    run_key: Optional[str] = opt(None, "join only the run whose creator has this public key (its `run key:` "
                                       "line); without it, the manifest most live peers train with")
    new_run: bool = opt(False, "with --initial-peers: start the run if the swarm has none by this name (without "
                               "it, a name the swarm does not know is refused, so that a typo never starts a run)")
    checkpoint_dir: Optional[str] = opt(None, "write a checkpoint here every round and resume from it")
    checkpoint_every: float = opt(600.0, "also checkpoint mid-round once this many seconds passed since the last "
                                         "checkpoint, so that a crash loses at most that much of a round's work "
                                         "(0 = at round ends only; with --overlap, once the last round's sync ended)")
    metrics_file: Optional[str] = opt(None, "append one JSON line per round to this file")
    max_rounds: int = opt(0, "stop after this many rounds (0 = run until stopped)")
    device: str = opt("auto", "cpu, cuda, cuda:N, or auto (cuda if available)")
    micro_batch: int = opt(0, "sequences per forward pass; accumulates gradients up to --batch-size (0 = all)")
    threads: int = opt(0, "torch CPU threads (0 = torch's default)")
    compile: bool = opt(False, "torch.compile the model: faster steps on a GPU after a compile of a minute or so")
    min_step_seconds: float = opt(0.0, "pad every inner step to at least this long: emulates a slower device, so "
                                       "that a benchmark of many peers on one machine does not measure CPU sharing")
    overlap: bool = opt(True, "run each round's sync in the background while the next round trains; the outer "
                              "update lands one round late (docs/design.md, step 8); --no-overlap: between rounds")
    quiet: bool = opt(False, "no progress bar: one summary line per round")
    tensorboard: Optional[str] = opt(None, "also log every round's numbers to TensorBoard, under DIR/RUN_ID/PEER_ID "
                                           "with the epoch as the step (pip install tensorboard)")
    wandb: Optional[str] = opt(None, "also log every round's numbers to this Weights & Biases project: the run's "
                                     "peers in one group, the epoch as the step, a restart resumed "
                                     "(pip install wandb)")
    dashboard: int = opt(0, "serve the swarm's dashboard (python -m peer status --serve) on this port (0 = off)")
    dashboard_host: str = opt("127.0.0.1", "the address --dashboard listens on (0.0.0.0: every interface)")
    verbose: bool = opt(False, "debug logs, hivemind's internals included")

    def __post_init__(self):
        if not self.run_id or any(c in self.run_id for c in ". /"):
            raise ValueError(f"run_id must be non-empty without '.', '/' or spaces, got {self.run_id!r}")
        require_non_negative(self, "max_rounds", "micro_batch", "threads", "min_step_seconds", "checkpoint_every",
                             "dashboard")


MIN_UPLINK_MBIT = 10.0  # the thinnest uplink of a home volunteer the deadlines are made for


@dataclass(frozen=True)
class SyncConfig:
    """Deadlines of the sync phase; every network wait has one."""

    allreduce_timeout: float = opt(60.0, "most seconds an all-reduce may take once its group is formed; the "
                                         "deadline follows measured all-reduce times below this (raised to 3 times "
                                         "a round's sends at 10 Mbit/s where that is longer)")
    deadline_factor: float = opt(3.0, "all-reduce deadline = this x the median of recent all-reduce times")
    deadline_floor: float = opt(5.0, "shortest all-reduce deadline, however fast recent all-reduces were")
    part_timeout: float = opt(15.0, "most seconds to wait for the next part from a groupmate before dropping it")
    request_timeout: float = opt(3.0, "seconds to wait for a matchmaking reply")
    sync_timeout: float = opt(0.0, "max seconds of sync per round, retries included (0 = derived)")
    retries: int = opt(2, "times to retry with the survivors after an all-reduce lost a member")
    max_upload: float = opt(0.0, "Mbit/s: pace this peer's bulk sends (all-reduce parts, results, state) below "
                                 "this rate, so that DHT reads and matchmaking never queue behind a round on a thin "
                                 "uplink; about 80%% of the uplink you measured (0 = unpaced)")

    def __post_init__(self):
        require_positive(self, "allreduce_timeout", "part_timeout", "request_timeout", "deadline_factor",
                         "deadline_floor")
        require_non_negative(self, "sync_timeout", "retries", "max_upload")

    def allreduce_ceiling(self, payload_bytes: float) -> float:
        """--allreduce-timeout, or three times what a round's sends (``payload_bytes``) take at the thinnest home
        uplink the defaults are made for (``MIN_UPLINK_MBIT``, or ``--max-upload`` below it), whichever is longer:
        a large model must finish its first all-reduce, before any is measured (``1b`` in 4 fragments at
        int4-huffman sends about 150 MB a round, a minute at 20 Mbit/s)."""
        uplink = min(MIN_UPLINK_MBIT, self.max_upload) if self.max_upload else MIN_UPLINK_MBIT
        return max(self.allreduce_timeout, 3 * payload_bytes * 8 / (uplink * 1e6))

    def round_budget(self, grace_seconds: float, allreduce_timeout: float) -> float:
        """The longest a round's sync may block this peer: matchmaking (our window, and as long again waiting for a
        leader whose window ends later: ``SwarmAverager.patience``) plus all-reduce, per attempt."""
        if self.sync_timeout:
            return self.sync_timeout
        return (1 + self.retries) * (2 * grace_seconds + 2 * self.request_timeout + allreduce_timeout)
