"""The averager as a process that may die (the kernel's OOM killer, a stray ``pkill``), or outlive its p2p daemon.

hivemind's averager runs in a process of its own. The peer's process calls into it through futures that only that
process resolves, and shares the averaged buffers with it under a lock that it holds through an all-reduce. A peer
whose averager had died waited out each call's timeout (a minute, in a sync that made two), and one killed holding
the lock would have held the buffers, and its peer, for good. Here each such wait ends as soon as the process is found
dead, with ``dht.processes.LinkLost``; and the averager's own shutdown survives a daemon that died before it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Optional, Sequence

import torch
from hivemind.utils import MPFuture

from dht import internals
from dht.processes import answer, holding

AVERAGING_PROCESS = "averaging process"  # what the user knows it as (``dht.processes.part_died``)

logger = logging.getLogger(__name__)


class Mortal:
    """Mixed into ``SwarmAverager`` (a hivemind ``DecentralizedAverager``), which sets ``_host_pid`` before it forks."""

    _host_pid: int  # the peer's process, which waits on the averager's

    def _answer(self, future: MPFuture, timeout: Optional[float]) -> Any:
        """Peer's process: the averager process's answer to ``future``; ``LinkLost`` as soon as it is found dead, and
        concurrent.futures' TimeoutError after ``timeout`` seconds."""
        return answer(future, self, AVERAGING_PROCESS, timeout)

    def wait_until_ready(self, timeout: Optional[float] = None) -> None:
        """hivemind's, which waited for good on an averager that died as it started (out of memory, say)."""
        self._answer(self._ready, timeout)

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[Sequence[torch.Tensor]]:
        """hivemind's: the buffers, held. In the peer's process, ``LinkLost`` if the averager dies meanwhile."""
        lock = self.lock_averaged_tensors
        with holding(lock, self, AVERAGING_PROCESS) if os.getpid() == self._host_pid else lock:
            yield internals.averaged_tensors(self)

    async def _shutdown(self, timeout: Optional[float]) -> None:
        """hivemind's, for a p2p daemon that may have died (``SwarmDHT.link_lost``): its handlers went with it. Its
        groups' all-reduces are cancelled as hivemind means to (``internals.cancel_running_groups``); a cancel leaves
        nothing to wait for, so ``timeout`` (hivemind's bound on that wait) goes unused."""
        if not self.client_mode:
            try:
                await self.remove_p2p_handlers(internals.averager_p2p(self), namespace=self.prefix)
            except (ConnectionError, OSError):  # the daemon is gone, and every group's streams with it
                logger.debug("the averager stopped after its p2p daemon")
        internals.cancel_running_groups(self)
