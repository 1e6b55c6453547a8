"""What a peer leaves behind and shows: checkpoints, progress, metrics, trackers, and the swarm's status.

- ``checkpoint.py``  atomic checkpoints
- ``report.py``      progress bar, round summary, metrics JSON lines
- ``orphans.py``     asyncio's records of hivemind's stream tasks collected after a failed all-reduce, kept quiet
- ``trackers.py``    TensorBoard and Weights & Biases
- ``status.py``      ``python -m peer status``: the swarm's peers, epochs, losses and forks
- ``dashboard.py``   ``status --serve`` and ``--dashboard``: the same snapshot as a page that refreshes itself
- ``plot.py``        ``python -m peer plot``: loss, group size and bytes per round, per peer
"""
