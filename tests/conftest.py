"""The suite runs its slow tests first, starts hivemind's processes as the product does, and leaves no sockets
behind in /tmp.

Slow tests first (in file order otherwise): the two workers then end the run on short tests, not one of them on a
test of a minute or more while the other has nothing left to take.

hivemind puts every p2p daemon's control socket and every client's listening socket in /tmp
(``/tmp/hivemind-p2pd-*.sock``, ``/tmp/hivemind-p2pclient-*.sock``). A process the tests SIGKILL never unlinks
them, nor does Python below 3.13 when a client closes its server, so each run left hundreds of files. At the end
of the run, the controller removes those created during it that nothing listens on any more.

The tests that start hivemind's DHTs and averagers in their own process fork them, as ``python -m peer`` does
(``dht.processes.fork_children``): Python 3.14's default, forkserver, cannot pickle them.
"""

import errno
import glob
import os
import socket
import time

from dht.processes import fork_children

SOCKETS = "/tmp/hivemind-*.sock"


def pytest_configure(config):
    fork_children()


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # (stable: file order within each kind)


def pytest_sessionstart(session):
    session.config.hivemind_sockets_since = time.time()


def pytest_sessionfinish(session):
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller sweeps once, after every worker
        return
    since = getattr(session.config, "hivemind_sockets_since", time.time())
    for path in glob.glob(SOCKETS):
        try:
            if os.stat(path).st_mtime >= since and not listened_on(path):
                os.unlink(path)
        except OSError:
            pass  # gone already, or not ours to remove


def listened_on(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError as e:
            return e.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    return True
