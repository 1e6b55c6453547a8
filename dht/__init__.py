"""The swarm layer: a thin wrapper over hivemind's DHT. No training code lives here.

- ``errors.py``     ``UserError``: a mistake the user can fix, shown as one line without a traceback
- ``cli.py``        argparse flags derived from frozen config dataclasses (help text from field metadata)
- ``addresses.py``  multiaddr validation with errors that say what is wrong and what to do
- ``node.py``       ``DHTConfig`` and ``start_dht``: start or join a swarm, stable identities, clear failures
- ``processes.py``  the helper processes (DHT, averager, p2p daemons): forked, stopped, gone with the peer; a wait
                    on one that died ends at once, naming it
- ``manifest.py``   the run manifest: what a run trains and with which settings, plus its hash
- ``records.py``    per-peer progress records (epoch, state hash, tokens, schedule) and the key schema
- ``reach.py``      the dial-back check: can others dial this node? (and its relay circuit addresses)
- ``joining.py``    ``start_reachable``: a peer's DHT, started again relayed or in client mode if nobody can dial it
- ``platform.py``   the platforms a peer runs on; native Windows exits at once with one line naming WSL2 and docker
- ``__main__.py``   ``python -m dht``: a bootstrap node that does not train
"""

import importlib
import sys
import types
import warnings

from dht.platform import require_supported


def _import_at_first_use(name: str) -> None:
    """Stand in for module ``name`` until one of its names is read: then import it for real (PEP 562's module
    ``__getattr__``). ``import name`` elsewhere gets the stand-in and costs nothing."""
    if name in sys.modules:
        return

    def __getattr__(attribute: str):
        if attribute.startswith("__"):  # inspect and the import system probe modules' dunders: not a use
            raise AttributeError(attribute)
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]
        return getattr(importlib.import_module(name), attribute)

    stand_in = types.ModuleType(name, f"{name}, imported at the first use of one of its names")
    stand_in.__getattr__ = __getattr__
    sys.modules[name] = stand_in


require_supported()
# hivemind imports scipy.optimize (0.4 s of CPU here, of a restart's 3 s: docs/design.md, "Startup") for a
# load-balancing LP that runs only when peers announce their bandwidths, which ours never do
_import_at_first_use("scipy.optimize")
# hivemind scripts two helpers with torch.jit at import. torch deprecates torch.jit.script, and from 2.15 it says so
# with a FutureWarning, which Python shows: two lines on every start of every command, the first thing a volunteer
# sees (pip installs today's torch). They are addressed to hivemind's authors; the scripted helpers run all the same.
warnings.filterwarnings("ignore", message="`torch.jit.script` is", module=r"torch\.jit\.")
