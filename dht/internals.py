"""Every reach into hivemind's private parts, in one place, for the one hivemind release they were written against.

hivemind 1.1.12 has no public way to do what a serverless, exact and measured round needs: dial a peer and
learn at once whether it is gone, drop a stale connection, keep the daemon client reading past a late reply and
hear when its daemon dies, sign DHT records with a peer's own identity key, count the bytes its p2p streams carry,
re-key and resize matchmaking for each round, tell when no group formed, and run a method in the averager's
process. Each function below does one of these through hivemind's private attributes. A new hivemind release may
move any of them, so ``check_version`` refuses one this module was not checked against, in one line, before
anything starts.

The subclasses of hivemind's all-reduce runner, part container and reducer (``peer/averaging/allreduce.py``)
and of its averager (``peer/averaging/averager.py``) override hivemind's own methods and use the fields they
inherit, as subclasses do; they, too, hold only for the versions named here.
"""

from __future__ import annotations

import asyncio
import logging
from math import isfinite
from typing import Any, Awaitable, Callable, List, Optional, Sequence, Set, Tuple

import hivemind
from hivemind.dht.crypto import RSAPrivateKey
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

from dht.errors import UserError

logger = logging.getLogger(__name__)

TESTED_VERSIONS = ("1.1.12",)  # hivemind releases whose internals this module was checked against


def check_version(version: str = hivemind.__version__) -> None:
    """A one-line error for a hivemind release this module was not checked against."""
    if version not in TESTED_VERSIONS:
        raise UserError(f"hivemind {version} is installed, but this peer relies on the internals of hivemind "
                        f"{' or '.join(TESTED_VERSIONS)}: pip install hivemind=={TESTED_VERSIONS[-1]}")


# ---- the p2p daemon ----
def dht_p2p(node) -> P2P:
    """The p2p client of a DHT node (inside the DHT's process)."""
    return node.protocol.p2p


def connect(p2p: P2P, peer_id: PeerID, addresses: Sequence[Any] = ()) -> Awaitable[None]:
    """Dial ``peer_id`` (at ``addresses``, or those the daemon knows), or reuse an open connection. hivemind's P2P
    has no public connect; its daemon client does."""
    return p2p._client.connect(peer_id, list(addresses))


def add_daemon_flags(**flags: Any) -> None:
    """Pass these flags to every p2p daemon this process starts from now on: p2pd has flags that ``P2P.create``
    does not expose (``-relayDiscovery``). Call it in the process that starts the daemon."""
    make = P2P._make_process_args
    P2P._make_process_args = staticmethod(lambda *args, **kwargs: make(*args, **{**kwargs, **flags}))


def disconnect(p2p: P2P, peer_id: PeerID) -> Awaitable[None]:
    """Close our daemon's connection to ``peer_id``, so that the next request dials afresh."""
    return p2p._client.disconnect(peer_id)


class _LiveCalls(dict):
    """A daemon client's unary calls awaiting their replies, where a call already given up (its future cancelled
    or done) counts as absent."""

    def __contains__(self, call_id: object) -> bool:
        future = self.get(call_id)
        return future is not None and not future.done()


def drop_late_replies() -> None:
    """Make every p2p daemon client this process (and its forks) creates from now on drop the reply to a unary call
    that was given up, instead of dying of it.

    hivemind's client reads all replies of its unary calls (every DHT request) on one connection, in one task, and
    sets each on its call's future if that call is pending. A call given up in the same turn of the event loop as
    its reply is read is still pending but its future is cancelled, and setting it raises InvalidStateError,
    which ends that task: every later DHT request of the process times out, for good, and the peer trains alone
    (its records read as silent, nobody downloads from it). From Python 3.12 on, ``asyncio.wait_for`` cancels at
    once when its timeout fires, so a process that stalls past a request's timeout while its daemon runs on (a
    SIGSTOP, a long call that holds the GIL) hits this as it resumes; on 3.11 and before, only an explicit cancel
    does. A given-up call now reads as absent, so its reply is dropped as unexpected, as hivemind does for calls it
    no longer knows. Idempotent."""
    init = ControlClient.__init__
    if getattr(init, "drops_late_replies", False):
        return

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._pending_calls = _LiveCalls(self._pending_calls)

    __init__.drops_late_replies = True
    ControlClient.__init__ = __init__


_ON_DAEMON_CLOSED: List[Callable[[], None]] = []  # what this process does when its daemon connection closes


def watch_daemon_connection(on_closed: Optional[Callable[[], None]] = None) -> None:
    """Keep every p2p daemon client this process (and its forks) creates from now on reading what its daemon sends,
    and act when it cannot any more.

    hivemind's client reads the replies of its unary calls (every DHT request) and the requests for its handlers
    in one task. Should that task end, the process is deaf to the swarm, and nothing says so: every request waits
    out its timeout, for good, and the peer trains alone. Now a message the task fails on is logged, skipped, and
    it reads on. When the daemon closes the connection (it died: killed, out of memory), the calls that wait fail
    at once, and each ``on_closed`` given in this process runs (the DHT's process tells its peer, which leaves:
    ``SwarmDHT.daemon_gone``). A client that closes itself cancels its reader: no ``on_closed`` runs. Late replies
    are dropped too (``drop_late_replies``). Idempotent; each call adds its ``on_closed``."""
    drop_late_replies()
    if on_closed is not None:
        _ON_DAEMON_CLOSED.append(on_closed)
    if getattr(ControlClient._ensure_persistent_conn, "reads_on", False):
        return

    async def _ensure_persistent_conn(self) -> None:  # hivemind's, with our reader
        reader, writer = await self.daemon_connector.open_persistent_connection()
        self._read_task = asyncio.create_task(_read_on(self, reader))
        self._write_task = asyncio.create_task(self._write_to_persistent_conn(writer))

    _ensure_persistent_conn.reads_on = True
    ControlClient._ensure_persistent_conn = _ensure_persistent_conn


async def _read_on(client: ControlClient, reader: asyncio.StreamReader) -> None:
    """hivemind's reader for ``client``, started again after a message it failed on; at the end of the stream the
    waiting calls fail and the hooks run (``watch_daemon_connection``)."""
    while True:
        try:
            await ControlClient._read_from_persistent_conn(client, reader)  # returns at the end of the stream
            break
        except (ConnectionError, OSError):  # the connection broke: nothing more will come
            break
        except Exception as e:  # hivemind's reader read the whole message first: the next one starts clean
            logger.warning(f"the p2p daemon client could not take a message from its daemon ({e!r}); reading on")
    closed = P2PDaemonError("the p2p daemon closed its control connection (it died: killed, or out of memory?)")
    for future in list(client._pending_calls.values()):
        if not future.done():
            future.set_exception(closed)
    logger.debug(f"{closed}")
    for on_closed in _ON_DAEMON_CLOSED:
        on_closed()


def rsa_key(der: bytes) -> RSAPrivateKey:
    """An RSA key from its DER bytes, by hivemind's own unpickling path."""
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})
    return key


def sign_records_with(key: RSAPrivateKey) -> None:
    """Make ``key`` the process-wide key that signs this process's DHT records (hivemind keeps one per process)."""
    with RSAPrivateKey._process_wide_key_lock:
        RSAPrivateKey._process_wide_key = key


def meter_streams(count_sent: Callable[[int], None], count_received: Callable[[int], None],
                  pace: Optional[Callable[[int], float]] = None, chunk: int = 16384, small: int = 4096) -> None:
    """Report the size of every message this process writes to or reads from its p2p streams, with hivemind's
    framing (a 1-byte marker and an 8-byte length per message). ``pace``: a message over ``small`` bytes is written
    in pieces of ``chunk``, each after the seconds ``pace(piece size)`` says (``peer/averaging/pacing.py``); smaller
    ones are booked with it and sent at once. Patches ``P2P`` for the whole process."""
    send, receive = P2P.send_raw_data, P2P.receive_raw_data
    overhead = 1 + P2P.HEADER_LEN

    async def send_raw_data(data, writer, *args, **kwargs):
        count_sent(len(data) + overhead)
        if pace is None or len(data) <= small:
            if pace is not None:
                pace(len(data) + overhead)
            return await send(data, writer, *args, **kwargs)
        writer.write(len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))  # hivemind's framing, written in pieces
        view = memoryview(data)
        for offset in range(0, len(view), chunk):
            piece = view[offset:offset + chunk]
            await asyncio.sleep(pace(len(piece) + (overhead if offset == 0 else 0)))
            writer.write(piece)
            await writer.drain()

    async def receive_raw_data(reader):
        data = await receive(reader)
        count_received(len(data) + overhead)
        return data

    P2P.send_raw_data, P2P.receive_raw_data = staticmethod(send_raw_data), staticmethod(receive_raw_data)


# ---- the averager and its process ----
def call_in_averager(averager, method: str, **kwargs) -> None:
    """Run ``averager.method(**kwargs)`` in the averager's own process, as hivemind's public methods do."""
    averager._outer_pipe.send((method, [], kwargs))


def averager_p2p(averager) -> P2P:
    """The averager process's replica of the p2p daemon client."""
    return averager._p2p


def averaged_tensors(averager) -> Sequence[Any]:
    """The tensors the averager averages, as it holds them (shared memory)."""
    return averager._averaged_tensors


def register_runner(averager, group_id, runner) -> None:
    """Hand the group's all-reduce runner to hivemind's RPC handlers, which route groupmates' parts to it."""
    averager._running_groups[group_id].set_result(runner)


def cancel_running_groups(averager) -> None:
    """Cancel the all-reduce of each group the averager runs, as its process shuts down. hivemind's ``_shutdown``
    means to, but calls ``finalize`` on the futures that hold the runners, not on the runners: a shutdown during an
    all-reduce ended the averager process with an AttributeError's traceback."""
    for registered in averager._running_groups.values():
        if registered.done() and not registered.cancelled():
            registered.result().finalize(cancel=True)
        else:
            registered.cancel()


def state_from_host(averager) -> Awaitable[Any]:
    """Ask the peer's main process for the state it shares (``get_current_state``)."""
    return averager._get_current_state_from_host_process()


def retrieve_runner_error(runner) -> None:
    """Mark a finished runner's exception as retrieved (raised already; else asyncio logs it as never retrieved)."""
    if runner._future.done() and not runner._future.cancelled():
        runner._future.exception()


# ---- matchmaking, one round at a time ----
def matchmaking(averager):
    """The averager's matchmaking (its process only)."""
    return averager._matchmaking


def use_round_key(matchmaking, bits: str) -> None:
    """Meet only the peers under these key bits this round. hivemind re-buckets the key after each group,
    assuming groups never exceed the target; our key is set afresh every round, so that is turned off (it raises
    when a group outgrows the target)."""
    async def keep_key(_group_info) -> None:
        pass

    manager = matchmaking.group_key_manager
    manager.group_bits = bits
    manager.update_key_on_group_assembled = keep_key


def forming_with(matchmaking) -> Set[str]:
    """The peers of the group our matchmaking is forming now: our leader, or our followers."""
    peers = set(matchmaking.current_followers)
    if matchmaking.current_leader is not None:
        peers.add(matchmaking.current_leader)
    return {peer.to_base58() for peer in peers}


def set_group_sizes(matchmaking, min_group: int, target: int) -> None:
    """A leader closes its group once ``target`` peers joined, or at the end of the window with ``min_group``."""
    matchmaking.min_group_size = min_group
    matchmaking._extra_members = set()  # the round's unexpected followers, each counted past the target once
    set_target(matchmaking, target)


def set_target(matchmaking, target: int) -> None:
    matchmaking.target_group_size = target
    matchmaking.group_key_manager.target_group_size = target
    matchmaking.potential_leaders.target_group_size = target


def group_sizes(matchmaking) -> tuple:
    """(min_group, target, window seconds) as set for this round."""
    return matchmaking.min_group_size, matchmaking.target_group_size, matchmaking.min_matchmaking_time


def join_lock(matchmaking):
    """The lock hivemind holds while a follower joins a leader: group sizes change under it only."""
    return matchmaking.lock_request_join_group


async def close_group_if_complete(matchmaking) -> bool:
    """If we lead a forming group that now holds the target, assemble it at once (as hivemind does when the last
    expected follower joins). Call under ``join_lock``."""
    if (matchmaking.is_looking_for_group and not matchmaking.client_mode and matchmaking.current_leader is None
            and matchmaking.current_followers and not matchmaking.assembled_group.done()
            and len(matchmaking.current_followers) + 1 >= matchmaking.target_group_size):
        await matchmaking.leader_assemble_group()
        return True
    return False


def raise_when_no_group(matchmaking, error: Callable[[str], BaseException]) -> None:
    """Make a matchmaking that ends without a group raise ``error`` instead of returning None, so that the caller
    sees a failure of its own type (hivemind raises a plain AllreduceException, told apart only by its text).
    Installed once per matchmaking."""
    if getattr(matchmaking, "_raises_when_no_group", False):
        return
    look_for_group = matchmaking.look_for_group

    async def look_or_raise(step):
        group = await look_for_group(step)
        if group is None:
            raise error("could not find a group")
        return group

    matchmaking.look_for_group = look_or_raise
    matchmaking._raises_when_no_group = True


def seed_leaders(matchmaking, source: Callable[[float], Awaitable[Optional[List[Tuple[str, float]]]]],
                 expected: Callable[[str], bool], unexpected: Callable[[str], bool] = lambda peer: False) -> None:
    """Fill matchmaking's leader queue from ``source(our declared expiration)``: (peer id, expiration) pairs, or None
    for hivemind's own lookup of the DHT's declarations. And accept a join request from a peer that ``expected``
    names even if its declared window ends before ours (hivemind refuses it: ``BAD_EXPIRATION_TIME``). A follower
    that ``unexpected`` names (one our records missed: a joiner whose record had not reached us) raises the target
    by one: hivemind's leader closes its group at the target's count, and the joiner, which came first, took the
    place of an expected member, which then missed the round (``tests/test_swarm.py``'s joiner). Installed once per
    matchmaking."""
    if getattr(matchmaking, "_seeded", False):
        return
    manager, leaders = matchmaking.group_key_manager, matchmaking.potential_leaders
    lookup, check = manager.get_averagers, matchmaking._check_reasons_to_reject

    async def get_averagers(group_key, only_active):
        seeded = await source(leaders.declared_expiration_time)
        if seeded is None:
            return await lookup(group_key, only_active)
        return [(PeerID.from_base58(peer), expiration) for peer, expiration in seeded]

    def check_reasons_to_reject(request, context):
        declared = leaders.declared_expiration_time
        if isfinite(declared) and request.expiration < declared and expected(context.remote_id.to_base58()):
            request = type(request).FromString(request.SerializeToString())
            request.expiration = declared
        verdict, peer = check(request, context), context.remote_id.to_base58()
        extra = getattr(matchmaking, "_extra_members", None)
        if verdict is None and extra is not None and peer not in extra and unexpected(peer):
            extra.add(peer)  # once a round: a follower that left and asks again is still one more
            set_target(matchmaking, matchmaking.target_group_size + 1)  # (under the join lock: hivemind holds it here)
        return verdict

    manager.get_averagers = get_averagers
    matchmaking._check_reasons_to_reject = check_reasons_to_reject
    matchmaking._seeded = True


def wait_past_window(matchmaking, seconds: Callable[[], float]) -> None:
    """Ask leaders to take us, and once accepted wait for their group, as if our window ended ``seconds()`` later.
    hivemind's follower gives up on its leader when its own window ends (plus a request timeout), while a leader
    waits out its own: a leader whose window ends later (it reached the meeting later) lost every follower that
    came before it. Measured: 10 of a 16-peer swarm's followers left one leader 2.5 s past their windows; 3 of them
    missed its group. Installed once per matchmaking."""
    if getattr(matchmaking, "_waits_past_window", False):
        return
    expiration = matchmaking.get_request_expiration_time
    matchmaking.get_request_expiration_time = lambda: expiration() + seconds()
    matchmaking._waits_past_window = True


def declare_in_background(matchmaking) -> None:
    """Send matchmaking's declarations (looking for a group, and no longer) to the DHT without waiting for its answer.
    hivemind awaits each one, and awaits the last one while leaving matchmaking: on a DHT that answers late, a group
    that formed stays in matchmaking until the DHT answers. Installed once per matchmaking."""
    manager = matchmaking.group_key_manager
    if getattr(manager, "_declares_in_background", False):
        return
    declare, pending = manager.declare_averager, set()

    async def declare_without_waiting(*args, **kwargs) -> bool:
        task = asyncio.create_task(declare(*args, **kwargs))
        pending.add(task)  # the event loop holds tasks weakly
        task.add_done_callback(pending.discard)
        return True

    manager.declare_averager = declare_without_waiting
    manager._declares_in_background = True
