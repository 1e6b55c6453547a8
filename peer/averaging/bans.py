"""Bans: a peer whose parts were rejected in ``ban_after`` rounds is ignored for the rest of the run.

Kept in the averager process across rounds. Only severe offences count (a rejected or non-finite part): an
honest stale peer's larger delta may be clipped, but never gets it banned (``peer/averaging/robust.py``).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Set

from hivemind.p2p import PeerID

logger = logging.getLogger(__name__)


class Bans:
    def __init__(self, ban_after: int):
        self.ban_after = ban_after  # 0: never ban
        self.offence_counts: Dict[PeerID, int] = {}
        self.banned: Set[PeerID] = set()

    def judge(self, offences: Dict[PeerID, Dict[str, str]], severe: Set[PeerID]) -> Dict[str, List[str]]:
        """Log what each offender's parts did in one all-reduce (as this peer reduced them), count the severe
        ones, and ban a peer at ``ban_after``. Returns {peer: [what its parts did]} for the round's metrics."""
        report = {}
        for peer, reasons in offences.items():
            self.offence_counts[peer] = self.offence_counts.get(peer, 0) + (peer in severe)
            described = [f"{reason} ({detail})" if detail else reason for reason, detail in sorted(reasons.items())]
            report[peer.to_base58()] = described
            logger.warning(f"peer {peer} sent bad parts: {', '.join(described)}; offence "
                           f"{self.offence_counts[peer]}{f' of {self.ban_after}' if self.ban_after else ''}")
            if self.ban_after and self.offence_counts[peer] >= self.ban_after and peer not in self.banned:
                self.banned.add(peer)
                logger.warning(f"banned peer {peer} for the rest of the run: its parts are ignored")
        return report
