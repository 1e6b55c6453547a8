"""The swarm layer: a thin wrapper over hivemind's DHT. No training code lives here.

- ``errors.py``     ``UserError``: a mistake the user can fix, shown as one line without a traceback
- ``cli.py``        argparse flags derived from frozen config dataclasses (help text from field metadata)
- ``addresses.py``  multiaddr validation with errors that say what is wrong and what to do
- ``node.py``       ``DHTConfig`` and ``start_dht``: start or join a swarm, stable identities, clear failures
- ``manifest.py``   the run manifest: what a run trains and with which settings, plus its hash
- ``records.py``    per-peer progress records (epoch, state hash, tokens, schedule) and the key schema
- ``reach.py``      the dial-back check: can others dial this node? (and its relay circuit addresses)
- ``joining.py``    ``start_reachable``: a peer's DHT, started again relayed or in client mode if nobody can dial it
- ``platform.py``   the platforms a peer runs on; native Windows exits at once with one line naming WSL2 and docker
- ``__main__.py``   ``python -m dht``: a bootstrap node that does not train
"""

from dht.platform import require_supported

require_supported()
