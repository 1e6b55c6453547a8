"""The training node. ``python -m peer`` runs one; see README.md and docs/design.md.

- ``__main__.py``  parse, build, run, close
- ``config.py``    RunConfig (the run manifest), NodeConfig, SyncConfig; the CLI is derived from them
- ``presets.py``   model presets (tiny, small, 150m, 1b) and their run defaults
- ``faults.py``    fault plans for tests: kill, freeze, slow, partition at six phases of a round
- ``train/``       local training: model, data, the inner loop, islands, flat vectors, theta as the sync sees it
- ``outer/``       the global state, its hash, the Nesterov outer step, lr schedules, own contributions
- ``swarm/``       pure functions over the swarm's records: consensus, deadlines
- ``averaging/``   the averager process: exact all-reduce, robust aggregation, liveness, state sharing
- ``round/``       the node and its rounds: sync, schedule
- ``ops/``         checkpoints, reports, trackers, status, plot
"""
