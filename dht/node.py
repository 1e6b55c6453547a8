"""Start or join a swarm: hivemind's DHT with validated addresses, stable identities and clear failures."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import functools
import logging
import multiprocessing
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Set, Tuple

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import ValidationError
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS

from dht import internals
from dht.addresses import parse_maddrs, scope
from dht.cli import opt, require_positive
from dht.errors import UserError, first_line
from dht.processes import LinkLost, answer, init_child_process, part_died, spawn_daemon_detached
from dht.reach import serve_dial_back
from dht.validation import RememberingValidator, adopt_identity, signer

logger = logging.getLogger(__name__)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
EMPTY_TABLE = "failed to find any peer in table"  # p2pd's answer to a lookup before its routing table has a peer
IDENTITY_CHECK_SECONDS = 10.0  # how long an identity check may wait for its probe's routing table to fill
FRESH_ADDRESSES_SECONDS = 10.0  # how long a node waits for the p2p daemon's fresh list of its addresses (ms, usually)


@dataclass(frozen=True)
class DHTConfig:
    """How this process joins the swarm's DHT."""

    initial_peers: Tuple[str, ...] = opt((), "multiaddrs of peers already in the swarm (any one is enough)")
    host_maddrs: Tuple[str, ...] = opt(("/ip4/0.0.0.0/tcp/0",), "multiaddrs to listen on; tcp/0 picks a free port")
    announce_maddrs: Tuple[str, ...] = opt((), "public multiaddrs to advertise, e.g. behind port forwarding")
    identity_path: Optional[str] = opt(None, "private key file that keeps the peer id (created if missing)")
    client_mode: bool = opt(False, "do not accept inbound connections (behind NAT without an open port)")
    if_unreachable: str = opt("client", "when the peers asked at start cannot dial this one (behind NAT, a closed "
                                        "port): switch to client mode (client); take a relayed address through "
                                        "the initial peers and stay a full member (relay: see the README for "
                                        "p2pd's relay limits); or only say so (warn)",
                              choices=("client", "relay", "warn"))
    relayed: bool = opt(False, "reachable through a relay circuit at the initial peers", cli=False)
    startup_timeout: float = opt(30.0, "seconds to wait for the p2p daemon to start and reach initial peers")

    def __post_init__(self):
        parse_maddrs(self.initial_peers, flag="--initial-peers", need_peer_id=True)
        parse_maddrs(self.host_maddrs, flag="--host-maddrs", need_peer_id=False)
        parse_maddrs(self.announce_maddrs, flag="--announce-maddrs", need_peer_id=False)
        require_positive(self, "startup_timeout")


class SwarmDHT(hivemind.DHT):
    """hivemind.DHT whose background process, and its p2p daemon, die with the process that started it.
    ``daemon_flags``: p2pd flags that hivemind does not expose. ``identity_check``: (identity path, initial
    peers): first ask the swarm whether a live peer uses that identity (``identity_taken``), in the DHT's own
    process, so that the process that started it goes on meanwhile (a peer builds its model). ``daemon_gone`` is
    set once its p2p daemon has died; then, or once the DHT's process has, the node can no longer reach the swarm
    (``link_lost``)."""

    def __init__(self, *args, daemon_flags: Optional[dict] = None, identity_check: Optional[tuple] = None, **kwargs):
        self.daemon_flags, self.identity_check = daemon_flags or {}, identity_check
        self.daemon_gone = multiprocessing.Event()
        self._answering: set = set()  # (in the DHT's process) the futures of the requests in flight
        super().__init__(*args, **kwargs)

    def shutdown(self) -> None:
        """hivemind's; but a node whose daemon died is killed at once: its shutdown would wait its grace period out on
        the daemon, and there is no one left to tell."""
        if self.daemon_gone.is_set() and self.is_alive():
            self.kill()
            self.join()
        else:
            super().shutdown()

    def link_lost(self) -> Optional[str]:
        """What to tell the user once this node's p2p daemon or DHT process has died, else None. (Call it in the
        process that started the node.)"""
        if self.daemon_gone.is_set():
            return part_died("p2p daemon")
        return None if self.is_alive() else part_died("DHT process")

    def run_coroutine(self, coro, return_future: bool = False):
        return self._answered(super().run_coroutine(coro, return_future=True), return_future)

    def get(self, *args, return_future: bool = False, **kwargs):
        return self._answered(super().get(*args, return_future=True, **kwargs), return_future)

    def store(self, *args, return_future: bool = False, **kwargs):
        return self._answered(super().store(*args, return_future=True, **kwargs), return_future)

    def wait_until_ready(self, timeout: Optional[float] = None) -> None:
        self._answered(self._ready, False, timeout)

    def get_visible_maddrs(self, latest: bool = False) -> list:
        """hivemind's, except that a fresh list (``latest``: the p2p daemon asked again) that fails, or has not come
        within ``FRESH_ADDRESSES_SECONDS``, gives the last list the daemon gave (at start, unless a fresh one came
        since). hivemind asks without a deadline, and once (Python 3.12, a full test run's load) the answer never
        came: the peer, asking at start for the addresses to print, waited for good, never trained, and could not
        leave on SIGTERM."""
        if latest:
            fresh = self.run_coroutine(functools.partial(hivemind.DHT._get_visible_maddrs, latest=True),
                                       return_future=True)
            asked = time.monotonic()
            try:
                return self._answered(fresh, False, FRESH_ADDRESSES_SECONDS)
            except LinkLost:
                raise
            except Exception as e:  # (a dropped request reads as a timeout too: ``_run_coroutine``)
                if time.monotonic() - asked < FRESH_ADDRESSES_SECONDS:
                    logger.debug(f"asking the p2p daemon for this node's addresses afresh failed: {e!r}")
                else:
                    logger.warning(f"the p2p daemon gave no fresh list of this node's addresses in "
                                   f"{FRESH_ADDRESSES_SECONDS:g} s: going on with those it gave before")
        return super().get_visible_maddrs()

    def _answered(self, future, return_future: bool, timeout: Optional[float] = None):
        """hivemind's calls (and ``peer_id``, ``get_visible_maddrs``, through ``run_coroutine``) that wait for the DHT
        process's answer, and its wait for the process to start, wait for good once it has died: ``python -m dht``
        hung asking its peer id of a DHT process killed a moment before (2 starts in 80). In the process that
        started the node, such a wait ends in ``LinkLost`` as soon as the process is found dead. (The averager's
        process calls them too: it can only wait.)"""
        if return_future:
            return future
        if os.getpid() != self._parent_pid:
            return future.result(timeout)
        return answer(future, self, "DHT process", timeout)

    async def _run_coroutine(self, coro, future) -> None:
        """Run one request in the DHT's process, as hivemind does, except that a request lost there reads as a
        timeout. hivemind keeps no reference to a request's task, so one whose awaited future nobody else holds
        is garbage-collected while pending ("Task was destroyed but it is pending!", 52 times in a 16-peer run on
        a loaded machine), and its caller got GeneratorExit: a peer starting there exited on one.

        The collector closes such a request wherever it runs, even while this thread sends another request's result
        under hivemind's lock on the results pipe (``MPFuture._update_lock``, not reentrant): setting the timeout
        from there froze the whole DHT process, and its peer with it (once on Python 3.12, at start). So the
        event loop sets it, once the collection is over.

        Until it is answered, a request's future is held here (``_answering``). The pipe that carries its answer is
        the future's own connection, and a request collected with its future closed that connection too: the timeout
        went into a closed pipe, and a caller that waits without a timeout (a peer asking for its addresses at
        start) waited for good (``tests/test_dht.py``)."""
        loop = asyncio.get_running_loop()
        self._answering.add(future)
        try:
            result = await coro(self, self._node)
        except GeneratorExit:
            try:
                loop.call_soon_threadsafe(self._answer, future, TimeoutError("the DHT process dropped this request"))
            except RuntimeError:  # the loop is closed: the process is stopping, and its caller with it
                pass
            raise
        except BaseException as e:  # the caller raises it
            logger.debug(f"a DHT request failed: {e!r}")
            self._answer(future, e)
        else:
            self._answer(future, result=result)

    def _answer(self, future, error: Optional[BaseException] = None, result=None) -> None:
        self._answering.discard(future)
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run(self) -> None:
        init_child_process()
        if self.identity_check is not None:
            try:
                if asyncio.run(identity_taken(*self.identity_check)):
                    raise P2PDaemonError("already taken by another peer")
            except Exception as e:  # the starting process raises it from wait_until_ready (``dht_ready``)
                self._ready.set_exception(e)
                return
        spawn_daemon_detached()
        internals.add_daemon_flags(**self.daemon_flags)
        internals.watch_daemon_connection(self.daemon_gone.set)
        # go-libp2p dials from its listening port (SO_REUSEPORT) unless told not to. Two peers that dial each
        # other at the same moment then open one TCP connection from both ends (a simultaneous open: the same
        # four addresses), both run the handshake as its initiator, and both dials fail ("noise: message is
        # too short"); their backoffs expire together, so they fail again, and never connect. Over a 100 ms
        # link that is every pair that syncs at once (tests/test_netns.py). Dialing from a fresh port costs
        # nothing here: hivemind does no hole punching, which is what reusing the port is for.
        os.environ["LIBP2P_TCP_REUSEPORT"] = "false"  # read by the p2p daemon this process starts
        super().run()


_THROWAWAY: Set[str] = set()  # the identity files signing_identity made up for a peer that named none


def discard_made_up_identity(config: DHTConfig) -> None:
    """Remove the identity file ``signing_identity`` made up for ``config``, once the node that uses it runs and no
    other will start from it (a restart into client mode or through a relay reads it again): a SIGKILLed peer runs
    no exit handler, and kills in tests and benchmarks had left 112 of them in /tmp."""
    if config.identity_path in _THROWAWAY:
        _THROWAWAY.discard(config.identity_path)
        shutil.rmtree(os.path.dirname(config.identity_path), ignore_errors=True)


def _check_identity_dir(config: DHTConfig) -> None:
    if config.identity_path:
        directory = os.path.dirname(os.path.abspath(config.identity_path))
        if not os.path.isdir(directory):
            raise UserError(f"--identity-path: directory {directory} does not exist; create it first")


def signing_identity(config: DHTConfig) -> Tuple[DHTConfig, bool]:
    """Give this node an identity file (a fresh one in a temporary directory when ``identity_path`` is unset)
    and sign this process's DHT records with its key (``dht.validation.adopt_identity``), so that the peer id
    is the signer's. Returns the config with the path, and whether the identity is new: nobody else can be
    using a new one, so ``start_dht`` need not ask the swarm. Call it before making any validator."""
    _check_identity_dir(config)
    if config.identity_path is None:
        directory = tempfile.mkdtemp(prefix="diloco-identity-")
        atexit.register(shutil.rmtree, directory, True)  # unless discard_made_up_identity removed it before
        config = dataclasses.replace(config, identity_path=os.path.join(directory, "identity.key"))
        _THROWAWAY.add(config.identity_path)
    fresh = not os.path.exists(config.identity_path)
    if fresh:
        P2P.generate_identity(config.identity_path)
    try:
        adopt_identity(config.identity_path)
    except Exception as e:
        raise UserError(f"--identity-path {config.identity_path} is not a p2p identity file ({first_line(e, 120)}); "
                        f"point it at another file (a missing one is created)") from None
    return config, fresh


def start_dht(config: DHTConfig, record_validators: Iterable[RecordValidatorBase] = (),
              check_identity: bool = True, await_ready: bool = True) -> SwarmDHT:
    """Start a DHT node; every failure a user can cause becomes a one-line ``UserError``. Every node signs its
    records and checks others' signatures (``dht/validation.py``); ``record_validators`` add to that.
    ``check_identity``: ask the swarm whether a live peer already uses ``identity_path`` (``identity_taken``).
    ``await_ready=False``: return once its process is forked, while its p2p daemon starts and reaches the initial
    peers (a peer builds its model meanwhile); ``dht_ready`` then waits for it, and says what failed."""
    internals.check_version()
    internals.watch_daemon_connection()
    validators = list(record_validators)
    if not any(isinstance(v, RSASignatureValidator) for v in validators):
        validators.insert(0, signer())
    initial_peers = [str(m) for m in parse_maddrs(config.initial_peers, flag="--initial-peers", need_peer_id=True)]
    _check_identity_dir(config)
    check = check_identity and initial_peers and config.identity_path and os.path.exists(config.identity_path)
    try:
        dht = SwarmDHT(
            initial_peers=initial_peers,
            host_maddrs=list(config.host_maddrs),
            announce_maddrs=list(config.announce_maddrs) or None,
            identity_path=config.identity_path,
            check_if_identity_free=False,  # ours, below: hivemind's asks once, too early (identity_taken)
            identity_check=(config.identity_path, initial_peers) if check else None,
            client_mode=config.client_mode,
            record_validators=[RememberingValidator(validators)],
            startup_timeout=config.startup_timeout,
            start=True,
            await_ready=False,
            **(_relayed(initial_peers) if config.relayed else {}),
        )
    except (P2PDaemonError, TimeoutError, concurrent.futures.TimeoutError) as e:
        raise _startup_error(e, config) from None
    return dht_ready(dht, config) if await_ready else dht


def dht_ready(dht: SwarmDHT, config: DHTConfig) -> SwarmDHT:
    """Wait until ``start_dht``'s node runs; its failures as ``start_dht`` says them."""
    try:
        dht.wait_until_ready()
        if not config.client_mode:
            serve_dial_back(dht)  # others may ask whether they can be dialled (dht/reach.py)
        return dht
    except (P2PDaemonError, TimeoutError, concurrent.futures.TimeoutError, ValidationError) as e:
        raise _startup_error(e, config) from None


def _startup_error(error: Exception, config: DHTConfig) -> UserError:
    if isinstance(error, P2PDaemonError):
        return UserError(explain_daemon_error(str(error), config))
    if isinstance(error, ValidationError):
        return UserError(explain_validation_error(str(error)))
    return UserError(f"the DHT did not start within {config.startup_timeout:.0f}s; check that the initial peers "
                     f"{' '.join(config.initial_peers) or '(none)'} are reachable, or raise --startup-timeout")


def _relayed(relays: list) -> dict:
    """hivemind's and p2pd's settings for a node nobody can dial, reachable through a circuit at ``relays``:
    it reserves a slot with them at once (static relays: p2pd's discovery would first wait up to 3 minutes for
    candidates), and advertises ``/p2p/<relay>/p2p-circuit`` addresses, which other peers dial through the relay."""
    return dict(use_relay=True, use_auto_relay=True, force_reachability="private", trusted_relays=relays,
                daemon_flags=dict(relayDiscovery=False))


async def identity_taken(identity_path: str, initial_peers: list, timeout: float = IDENTITY_CHECK_SECONDS) -> bool:
    """Does a live peer of the swarm use this identity? A probe daemon joins the swarm and connects to the
    identity's peer id. hivemind's own check (``P2P.is_identity_taken``) asks once, at once: on a busy machine
    the probe's routing table is still empty then (p2pd answers EMPTY_TABLE; 1 try in 6 with two cores busy)
    and the identity looks free, so the second process starts under the first one's id. We ask again until
    the table holds a peer, within ``timeout``."""
    with open(identity_path, "rb") as f:
        peer_id = PeerID.from_identity(f.read())
    probe = await P2P.create(initial_peers=initial_peers, dht_mode="client")
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                await internals.connect(probe, peer_id)
                return True
            except ControlFailure as e:
                if EMPTY_TABLE not in str(e) or time.monotonic() > deadline:
                    return False
            await asyncio.sleep(0.1)
    finally:
        await probe.shutdown()


def explain_daemon_error(message: str, config: DHTConfig) -> str:
    """Turn p2pd's failure text into what happened and what to do."""
    if "failed to connect to bootstrap peers" in message:
        return (
            f"could not reach any initial peer ({' '.join(config.initial_peers)}): check the addresses, that "
            f"those peers are running, and that their ports are open to you"
        )
    if "address already in use" in message:
        return (
            f"cannot listen on {' '.join(config.host_maddrs)}: the port is already in use; pick a free port "
            f"or use tcp/0"
        )
    if "already taken by another peer" in message:
        return (
            f"identity {config.identity_path} is used by another live peer; give each peer its own "
            f"--identity-path (or --checkpoint-dir)"
        )
    if "cannot assign requested address" in message:
        return f"cannot listen on {' '.join(config.host_maddrs)}: that address is not on this machine"
    return f"the p2p daemon failed to start: {message.strip()}"


def explain_validation_error(message: str) -> str:
    """hivemind's DHT refuses to join a swarm whose time (in its ping's answer) is more than
    ``MAX_DHT_TIME_DISCREPANCY_SECONDS`` (3) from this machine's: its records expire by the clock. Say by how much
    this clock is off, and how to set it."""
    times = re.search(r"local: ([\d.]+), peer: ([\d.]+)", message)
    if times is None:
        return f"an initial peer refused this one: {message.strip()}"
    off = float(times.group(1)) - float(times.group(2))
    return (f"this machine's clock is {abs(off):.1f} s {'ahead of' if off > 0 else 'behind'} an initial peer's, "
            f"and the swarm's DHT accepts at most {MAX_DHT_TIME_DISCREPANCY_SECONDS:g} s: set the clock from the "
            f"network (Linux: sudo timedatectl set-ntp true; WSL2, after a sleep: sudo hwclock -s; macOS and "
            f"Windows: set the time automatically), then start again")


def visible_maddrs(dht: SwarmDHT) -> list:
    """Addresses other peers can dial, best first: public, then private, then loopback (``scope``). The p2p daemon's
    fresh answer, or where that failed or came late the addresses it gave before (``SwarmDHT.get_visible_maddrs``)."""
    maddrs = [str(m) for m in dht.get_visible_maddrs(latest=True)]
    return sorted(set(maddrs), key=lambda m: (scope(m), m))


async def _ping_peers(peer_ids: Tuple[str, ...], drop: bool, _dht, node) -> Tuple[str, ...]:
    peers = [PeerID.from_base58(peer_id) for peer_id in peer_ids]
    answers = await asyncio.gather(*map(node.protocol.call_ping, peers), return_exceptions=True)
    unanswered = tuple(peer_id for peer_id, answer in zip(peer_ids, answers)
                       if answer is None or isinstance(answer, BaseException))
    if drop:
        await drop_connections(internals.dht_p2p(node), unanswered)
    return unanswered


async def drop_connections(p2p, peer_ids: Iterable[str]) -> List[str]:
    """Close our p2p daemon's connections to these peers, which did not answer a ping: after a partition heals, TCP's
    retransmission backoff held the next pings on the old connection for seconds past the heal, where a fresh dial
    goes through at once. Returns those it was connected to."""
    dropped = []
    for peer_id in peer_ids:
        try:
            await internals.disconnect(p2p, PeerID.from_base58(peer_id))
            dropped.append(peer_id)
        except Exception as e:  # not connected at all
            logger.debug(f"disconnect from {peer_id} failed: {e!r}")
    if dropped:
        logger.debug(f"dropped the connections to {', '.join(dropped)}: no answer to a ping")
    return dropped


def reach_out(dht: hivemind.DHT, peer_ids: Iterable[str],
              drop: Optional[Callable[[Tuple[str, ...]], Any]] = None):
    """Ping these peers in the background, putting each of us back into the other's routing table; returns a
    future of those that did not answer (None if there was nobody to ping).

    hivemind's DHT drops a node from its routing table when a request to it fails and never looks for it
    again, so after a partition heals the halves stay apart until something else reconnects them (the
    bootstrap node, if it sat in the other half, is forgotten too). A ping on each side fixes that.

    The connection to each peer that did not answer is closed (``drop_connections``), by the DHT, or, given ``drop``,
    by whoever ``drop`` hands them to: a peer that averages leaves that to its averager, which keeps the connections
    it streams over (``SwarmAverager.drop_connections``)."""
    peer_ids = tuple(sorted(set(peer_ids)))
    if not peer_ids:
        return None
    pinged = dht.run_coroutine(functools.partial(_ping_peers, peer_ids, drop is None), return_future=True)
    if drop is not None:
        def hand_over(future) -> None:
            if not future.cancelled() and future.exception() is None and future.result():
                drop(future.result())

        pinged.add_done_callback(hand_over)
    return pinged
