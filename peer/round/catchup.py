"""Catching up: adopt the swarm's best state when it beats ours, keeping our own unmerged work.

- ``catch_up``: by the fork choice (``consensus.choose_state``), reach the best state, check its hash, and rebase onto
  it (``peer/outer/lineage.py``). A few rounds behind, by replaying them: each round's result (what its members
  decoded) from a peer that holds it, and the outer step taken here, bit for bit as the members took it; else by
  downloading the whole state from its holders. Our record says we are fetching it meanwhile, so its holders' next
  group waits for us.
- ``settle``: after an attempt that failed for us once our reducer had finished (or a minority group), look for
  our group's finished state and adopt it, before averaging our delta again into a different state.
- ``hand_over``: before leaving, serve our state while peers that lack it could get it from nobody else.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple, Union

import torch
from diloco_compression.feedback import ErrorFeedback

from dht.reach import Reach
from dht.records import PeerRecord
from peer.config import RunConfig, SyncConfig
from peer.outer.fragments import Fragments
from peer.outer.lineage import Lineage, Rebase, rebase_kind
from peer.outer.nesterov import nesterov_step
from peer.outer.state import GlobalState, merge_contributors, state_hash
from peer.round.announce import Announcer
from peer.round.decide import settle_longer
from peer.swarm.clock import Clock
from peer.swarm.consensus import awaiting_state, choose_state, responsive, syncing_now
from peer.swarm.deadlines import Deadlines
from peer.swarm.records import RecordCache
from peer.train.flat import FlatLayout
from peer.train.local import LocalModel

logger = logging.getLogger(__name__)

SETTLE_SECONDS, SETTLE_POLL = 2.0, 0.25  # how long a failed member looks for its group's finished state
LOOKUP_TIMEOUT = 2.0  # seconds a look at the swarm's records may block training (a partition slows the DHT)
REPLAY_ROUNDS = 8  # rounds a peer this far behind replays rather than downloads (as many as a member serves)
MEMBER_POLL = 1.0  # seconds between reads of the records while a late sync waits for its last groupmates


@dataclass(frozen=True)
class CatchUp:
    adopted: bool = False  # we rebased onto the swarm's better state
    merged_ours: bool = False  # that state merged the delta we had just attempted (``attempted_epoch``)
    unreachable: bool = False  # a better state exists, but none of its holders served it


class StateCatchUp:
    def __init__(self, *, transport, clock: Clock, cache: RecordCache, announcer: Announcer, state: GlobalState,
                 local: LocalModel, layout: FlatLayout, lineage: Lineage, feedback: ErrorFeedback,
                 lock: threading.Lock, deadlines: Deadlines, run: RunConfig, sync: SyncConfig):
        self.transport, self.clock, self.cache, self.announcer = transport, clock, cache, announcer
        self.state, self.local, self.layout, self.lineage, self.feedback = state, local, layout, lineage, feedback
        self.lock, self.deadlines, self.run, self.config = lock, deadlines, run, sync
        self.fragments = Fragments(layout.numel, run.fragments)

    def refresh(self, poll: bool = False) -> Dict[str, PeerRecord]:
        """Read the swarm's records (within what a matchmaking request may take: a lookup crosses several hops).
        ``poll``: without waiting: the answer of a lookup made since the last look, or else what we knew, while the
        lookup goes on (``RecordReader``)."""
        fetched = self.transport.read_records(0.0 if poll else max(LOOKUP_TIMEOUT, self.config.request_timeout))
        if fetched is None and poll:
            return self.cache.records
        return self.cache.update(fetched, self.clock.dht_time())

    def judged_at(self) -> float:
        """The DHT time to judge the records' liveness at (``RecordCache.as_of``)."""
        return self.cache.as_of(self.clock.dht_time())

    def holders_syncing(self, within: float = 0.0) -> bool:
        """Are the holders of our state in a sync now, or in one ``within`` seconds (``consensus.syncing_now``)? A
        fresh look: records read before a download predate it."""
        return bool(syncing_now(self.refresh().values(), self.announcer.record(), self.judged_at(), within))

    def await_members(self, members: Set[str], until: float) -> None:
        """Read the records every ``MEMBER_POLL`` seconds until each of ``members`` holds our epoch or later, is
        silent or gone, or ``until`` (monotonic) passes."""
        epoch = self.announcer.record().epoch
        while members and self.clock.monotonic() < until:
            records = self.refresh()
            now = self.judged_at()
            members = {peer for peer in members if peer in records and records[peer].epoch < epoch
                       and responsive(records[peer], now)}
            if members:
                self.clock.sleep(MEMBER_POLL)

    def catch_up(self, timeout: float, attempted_epoch: Optional[int] = None, poll: bool = False) -> CatchUp:
        """Adopt the swarm's best state if it beats ours. ``attempted_epoch``: we just sent our delta in an
        all-reduce at this epoch that failed for us; if the adopted state merged it there, ``merged_ours``.
        ``poll``: judge by the records a lookup has brought so far (``refresh``).

        If no holder served it, they may have moved on while we asked (each answers that it no longer holds that
        state): a fresh look finds where they went, and we try that state, within ``timeout``. Giving up there
        cost a round: right after a 2|2 split healed, the losing half asked for the winners' state as they stepped
        past it, trained on its own, and missed the winners' next group (``tests/test_faults.py``)."""
        until = self.clock.monotonic() + timeout
        records, tried, found = self.refresh(poll), set(), CatchUp()
        while True:
            best = choose_state(records.values(), self.announcer.record())
            if best is None or best.state_hash in tried:
                break
            tried.add(best.state_hash)
            found = self._reach(best, max(until - self.clock.monotonic(), 1.0), attempted_epoch)
            if not found.unreachable or self.clock.monotonic() >= until:
                break
            logger.info(f"no holder served epoch {best.epoch} ({best.state_hash[:8]}); looking where they went")
            records = self.refresh()
        if found.unreachable:
            logger.warning("could not download the swarm's state from any holder; training on ours for now")
        return found

    def _reach(self, best: PeerRecord, timeout: float, attempted_epoch: Optional[int]) -> CatchUp:
        """Reach ``best``: replay the rounds to it, or download it from its holders; rebase onto it."""
        holders = [r for r in self.cache.records.values() if r.state_hash == best.state_hash and not r.client_mode]
        direct = [r for r in holders if r.reach != Reach.RELAYED.value]  # a relay carries little, and slowly
        donors = [r.peer_id for r in direct or holders]
        self.announcer.adopting(best.state_hash)  # its holders' next group expects us (``consensus.joining``)
        try:
            kind = self._replay(best, timeout, attempted_epoch)
            if kind is not None:
                return CatchUp(adopted=True, merged_ours=kind is Rebase.OURS_MERGED)
            logger.info(f"swarm is at epoch {best.epoch} ({best.state_hash[:8]}), we are at {self.state.epoch}: "
                        f"downloading the state from {len(donors)} peer(s)")
            downloaded = self.transport.download(donors, best.state_hash, timeout=timeout,
                                                 part_timeout=self.deadlines.part(), relayed=not direct)
            if downloaded is None:
                return CatchUp(unreachable=True)
            used, metadata, tensors = downloaded
            kind = self.adopt(metadata, tensors, attempted_epoch)
            if kind is None:
                logger.warning(f"the state from {', '.join(used)} fails its hash check; ignored")
                return CatchUp()
            logger.info(f"adopted epoch {self.state.epoch} ({self.state.hash()[:8]}), downloaded from "
                        f"{len(used)} peer(s)")
            return CatchUp(adopted=True, merged_ours=kind is Rebase.OURS_MERGED)
        finally:
            self.announcer.adopting(None)  # republished at once, with the state we adopted if we did

    def _replay(self, best: PeerRecord, timeout: float, attempted_epoch: Optional[int]) -> Optional[Rebase]:
        """Reach ``best`` by replaying the rounds from our state to it: each round's result from a peer past our epoch
        (the holders of ``best`` first: they hold every round of its lineage), the outer step of its fragment taken
        here, then the end state checked against ``best``'s hash and adopted. None (nothing changed) if a round is
        not served, ``best`` is too far ahead, or the end state is another (``best`` is on another lineage)."""
        rounds = best.epoch - self.state.epoch
        if not 0 < rounds <= REPLAY_ROUNDS:
            return None
        why = self._replay_rounds(best, rounds, timeout, attempted_epoch)
        if isinstance(why, str):
            logger.info(f"could not replay the {rounds} round(s) to epoch {best.epoch}: {why}")
            return None
        return why

    def _replay_rounds(self, best: PeerRecord, rounds: int, timeout: float,
                       attempted_epoch: Optional[int]) -> Union[Rebase, str]:
        """``_replay``'s work: the rebase, or why not."""
        now = self.judged_at()
        ahead = sorted((r for r in self.cache.records.values() if r.epoch > self.state.epoch and not r.client_mode
                        and responsive(r, now)), key=lambda r: (r.state_hash != best.state_hash, -r.epoch))
        donors = [r.peer_id for r in ahead]
        if not donors:
            return "no responsive peer is past our epoch"
        deadline = self.clock.monotonic() + timeout
        params, momentum = self.state.params.clone(), self.state.momentum.clone()
        epoch, tokens_total, merged = self.state.epoch, self.state.tokens_total, dict(self.state.merged)
        for _ in range(rounds):
            averaged = self.transport.replay(donors, epoch, state_hash(params, momentum, epoch),
                                             timeout=max(deadline - self.clock.monotonic(), 0.1),
                                             part_timeout=self.deadlines.part())
            if averaged is None:
                return f"none of {len(donors)} peer(s) served round {epoch}'s result"
            part = self.fragments.of(epoch)
            with self.transport.buffers() as tensors:
                average = tensors[0][: part.stop - part.start].clone()
            if not torch.isfinite(average).all():
                return f"round {epoch}'s result is not finite"
            step = self.run.global_step(epoch)
            nesterov_step(params[part], momentum[part], average, self.run.outer_lr_at(step),
                          self.run.outer_momentum_at(step))
            merged = merge_contributors(merged, averaged.gathered, epoch)
            epoch, tokens_total = epoch + 1, tokens_total + averaged.group_tokens()
        kind = self.adopt(dict(epoch=epoch, tokens_total=tokens_total, merged=merged, hash=best.state_hash),
                          [params, momentum], attempted_epoch)
        if kind is None:
            return "the replayed state fails the swarm's hash (it is on another lineage)"
        logger.info(f"adopted epoch {self.state.epoch} ({self.state.hash()[:8]}) by replaying {rounds} round(s) "
                    f"from {len(donors)} peer(s)")
        return kind

    def adopt(self, metadata: dict, tensors: List[torch.Tensor],
              attempted_epoch: Optional[int] = None) -> Optional[Rebase]:
        """Verify a downloaded (G, m, e) against its hash and rebase onto it; None if it fails the check."""
        try:
            params, momentum = (t.to(torch.float32).reshape(-1).contiguous() for t in tensors)
            epoch, tokens_total, claimed = int(metadata["epoch"]), int(metadata["tokens_total"]), metadata["hash"]
            merged = {str(k): int(v) for k, v in dict(metadata.get("merged", {})).items()}
        except (KeyError, TypeError, ValueError):
            return None
        if params.numel() != self.layout.numel or momentum.numel() != self.layout.numel:
            return None
        if state_hash(params, momentum, epoch) != claimed:
            return None
        ours = merged.get(self.announcer.identity.peer_id, -1)
        kind = rebase_kind(ours, attempted_epoch, self.lineage.take_resumed_epoch())
        # the fragment whose outer step merged our work (the whole vector without fragments): theta <- G_new there
        part = self.fragments.of(ours)
        with self.lock:
            if kind is Rebase.OURS_MERGED:  # what we sent, carried deltas included, is merged
                sent = self.lineage.own_delta(self.state.params, self.local.gather(self.layout.empty()))[part]
                self.feedback.fragment(part).commit(sent)
            self.lineage.rebase(kind, ours, params, part)
            shift = params - self.state.params
            if kind is Rebase.KEEP_WORK:
                self.local.shift(shift)
            elif self.fragments.whole():
                self.local.set(params)
            else:  # the rest of the model keeps the work of the steps since it was last averaged
                shift[part] = 0
                self.local.shift(shift)
                self.local.set(params, part)
            self.state.params, self.state.momentum = params, momentum
            self.state.epoch, self.state.tokens_total, self.state.merged = epoch, tokens_total, merged
        return kind

    def settle(self, their_end: float, deadline: float, attempts: int) -> Tuple[CatchUp, int]:
        """After an attempt that failed for us once our reducer had finished: did some groupmate finish it? (Also
        after a minority group: when does the majority's state appear?) A lost reducer, or a deadline that fired on
        us first, can fail the all-reduce for us after the others received every part and applied it. Retrying at
        once would average our delta a second time, into a different state (a fork). So first look for a
        groupmate's new state (members publish it as soon as they apply) until SETTLE_SECONDS past ``their_end``
        (monotonic), when the last of them must have finished or failed too, and adopt it if it appears.

        If by then we see that state but none of its holders answers (a reducer that finished the round, then lost
        its link), we spend our next attempt's time (within ``deadline``) trying again (``decide.settle_longer``):
        its link may come back. (Measured: a 6-s cut at a reducer's reduce phase; the others' download from it
        timed out in TCP's retransmission backoff after the link was back, and they retried as a pair, so the
        round's group held two states for a round.) Returns what we found, and the attempts spent on it (0 or 1)."""
        attempted, clock = self.state.epoch, self.clock
        settle_until = max(clock.monotonic(), their_end) + SETTLE_SECONDS
        extended = False
        while True:
            found = self.catch_up(timeout=max(settle_until - clock.monotonic(), 1.0), attempted_epoch=attempted)
            if found.adopted:
                return found, int(extended)
            now = clock.monotonic()
            if now >= settle_until:
                if not settle_longer(extended, found.unreachable, attempts + extended, self.config.retries,
                                     deadline - now):
                    return found, int(extended)
                extended = True
                settle_until = min(deadline, now + self.run.grace_seconds + self.deadlines.allreduce() + SETTLE_SECONDS)
                logger.info("our group's new state is held by peers that do not answer now; trying again for "
                            f"{settle_until - now:.0f}s before averaging without them")
                continue
            clock.sleep(SETTLE_POLL)

    def hand_over(self) -> List[str]:
        """Before leaving (our record says ``LEAVING``): stay, serving our state, while peers that lack it could get
        it from nobody else (``consensus.awaiting_state``), for at most as long as a member may look for its group's
        state (``settle``: grace + all-reduce deadline + SETTLE_SECONDS). Returns those still without it."""
        timeout = self.run.grace_seconds + self.deadlines.allreduce() + SETTLE_SECONDS
        mine, deadline = self.announcer.record(), self.clock.monotonic() + timeout
        while True:
            missing = awaiting_state(self.refresh().values(), mine, self.judged_at())
            if not missing or self.clock.monotonic() >= deadline:
                return missing
            self.clock.sleep(SETTLE_POLL)
