"""The group metadata every member of a group reads identically: what each one tells the others in matchmaking.

hivemind gathers one blob from each member while the group forms and hands every member the same list. Each
member's blob is its ``Contribution``; every decision the group takes from them (may it apply the round? how long
is the next round? when does the round in progress end?) is a pure function of the gathered contributions, so
every member takes the same one without another message. On the wire a contribution is a plain dict (hivemind's
MessagePack serializer), with the keys below; a member whose blob does not parse fails the attempt for everyone
alike.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass(frozen=True)
class Contribution:
    """One member's word to its group."""

    epoch: int  # the epoch of the state it averages from
    hash: str  # that state's hash: the group key makes it ours, and the outer step checks it again
    tokens: int  # tokens behind its pseudo-gradient (the merge counts them into tokens_total)
    align: bool = False  # it sends AdamW's first moment too (every --align-every rounds)
    step_seconds: Optional[float] = None  # its recent seconds per inner step: the next round's length follows
    missed: int = 0  # rounds in a row it sat at this state without applying (the majority rule's escape)
    voters: int = 1  # the electorate it counts, itself included (``consensus.voters``)
    planned_end: Optional[float] = None  # overlap: when its round in progress is planned to end (DHT time)
    weight: float = 0.0  # its weight in the average (tokens, discounted when stale): its group's total is the group's
    groups: int = 1  # how many groups its sender expects the round to have (1: one group of all; ``swarm/grouping``)
    client: bool = False  # its sender accepts no connections: it cannot serve the round's result as a delegate
    sync_seconds: Optional[float] = None  # overlap: how long its recent syncs took (the next round lasts longer)
    late: int = 0  # overlap: live peers it sees catching up to our state (``consensus.catching_up``)

    def to_wire(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, value: Any) -> "Contribution":
        """Parse a member's blob; ValueError naming what is wrong with it."""
        if not isinstance(value, dict):
            raise ValueError(f"group metadata must be a dict, got {type(value).__name__}")
        try:
            contribution = cls(epoch=value["epoch"], hash=value["hash"], tokens=value["tokens"],
                               align=value.get("align", False), step_seconds=value.get("step_seconds"),
                               missed=value.get("missed", 0), voters=value.get("voters", 1),
                               planned_end=value.get("planned_end"), weight=value.get("weight", 0.0),
                               groups=value.get("groups", 1), client=value.get("client", False),
                               sync_seconds=value.get("sync_seconds"), late=value.get("late", 0))
        except KeyError as e:
            raise ValueError(f"group metadata lacks {e.args[0]!r}") from None
        contribution.check()
        return contribution

    def check(self) -> None:
        for name in ("epoch", "tokens", "missed", "voters", "groups", "late"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"group metadata {name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.hash, str) or not isinstance(self.align, bool) or not isinstance(self.client, bool):
            raise ValueError(f"group metadata hash must be a string, align and client bools, got {self.hash!r}, "
                             f"{self.align!r}, {self.client!r}")
        if not isinstance(self.weight, (int, float)) or isinstance(self.weight, bool) or \
                not 0 <= self.weight < float("inf"):
            raise ValueError(f"group metadata weight must be a finite number >= 0, got {self.weight!r}")
        for name in ("step_seconds", "planned_end", "sync_seconds"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not math.isfinite(value)):
                raise ValueError(f"group metadata {name} must be a finite number or None, got {value!r}")


Gathered = Dict[str, Contribution]  # peer id -> its contribution, the same on every member


@dataclass(frozen=True)
class Delegation:
    """A delegate's word in the cross-group phase: its group's gathered contributions, its own included. The
    cross-group average weighs the group's average by their total weight."""

    epoch: int
    hash: str
    align: bool
    members: Gathered

    def weight(self) -> float:
        return sum(contribution.weight for contribution in self.members.values())

    def to_wire(self) -> Dict[str, Any]:
        return dict(epoch=self.epoch, hash=self.hash, align=self.align,
                    members={peer: c.to_wire() for peer, c in self.members.items()})

    @classmethod
    def from_wire(cls, value: Any) -> "Delegation":
        """Parse a delegate's blob; ValueError naming what is wrong with it."""
        if not isinstance(value, dict) or not isinstance(value.get("members"), dict) or not value["members"]:
            raise ValueError("a delegation must be a dict with a non-empty dict of members")
        members = {str(peer): Contribution.from_wire(c) for peer, c in value["members"].items()}
        epoch, state, align = value.get("epoch"), value.get("hash"), value.get("align")
        if any((c.epoch, c.hash, c.align) != (epoch, state, align) for c in members.values()):
            raise ValueError("a delegation's members must hold its epoch, hash and alignment")
        return cls(epoch=epoch, hash=state, align=align, members=members)


@dataclass(frozen=True)
class Averaged:
    """What a successful all-reduce hands back to the peer: the group's metadata and how the round went."""

    gathered: Gathered
    aligned: bool  # the first moments were averaged too
    seconds: float  # from the group formed to the averages received
    offences: Dict[str, List[str]] = dataclasses.field(default_factory=dict)  # peer -> its bad parts we reduced
    groups: int = 1  # the groups whose contributions it merged (a cross-group round: their delegates)
    reduced: float = 0.0  # the fraction of the averaged vector this peer reduced (0 in client mode)

    def group_tokens(self) -> int:
        return sum(contribution.tokens for contribution in self.gathered.values())
