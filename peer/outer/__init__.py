"""The outer optimizer and the global state: pure tensors on the CPU in fp32, the same bits on every member.

- ``state.py``          ``GlobalState`` (G, m, e, tokens, lineage) and ``state_hash``
- ``nesterov.py``       the FMA-free Nesterov outer step
- ``schedule.py``       the inner and outer lr schedules (a portable cosine)
- ``fragments.py``      streaming fragments: which part of the flat vector a round averages
- ``contributions.py``  this peer's own recent deltas, kept encoded
- ``lineage.py``        what a rebase keeps, carries or drops of this peer's unmerged work
"""
