"""The training node. ``python -m peer`` runs one; see README.md and docs/design.md.

- ``__main__.py``  parse, build, run, close
- ``config.py``    RunConfig (the run manifest), NodeConfig, SyncConfig; the CLI is derived from them
- ``config_file.py`` --config: every flag from a TOML file (bundled ones in ``configs/``), type-checked
- ``presets.py``   model presets (micro, tiny, small, 150m, 1b) and their run defaults
- ``hooks.py``     the points a test harness may act at; the product's hooks do nothing
- ``train/``       local training: model, data, the inner loop, islands, flat vectors, theta as the sync sees it
- ``outer/``       the global state and its hash, the Nesterov outer step, lr schedules, contributions, lineage
- ``swarm/``       pure functions over the swarm's records and group metadata: consensus, timing, deadlines
- ``averaging/``   the averager process: exact all-reduce, robust aggregation, bans, liveness, state sharing
- ``round/``       the round: its decisions, the sync that acts on them, catch-up, transport, the node
- ``use/``         the model out: export to a Hugging Face directory, generate
- ``ops/``         checkpoints, reports, trackers, status, plot

Layers, bottom first (imports point down only; ``tests/test_layers.py``): ``compression``, ``dht``; ``hooks``,
``presets``, ``outer``, ``swarm``, ``ops``; ``config``; ``train``, ``averaging``, ``config_file``; ``round``;
``use``; ``__main__``.
"""
