"""What runs in the averager process: hivemind's DecentralizedAverager, made exact, robust and shareable.

- ``averager.py``   ``SwarmAverager``: round keys, the consensus gate, the all-reduce, bans, state sharing
- ``allreduce.py``  the exact butterfly all-reduce (bit-identical results or a clean failure)
- ``robust.py``     robust aggregation of one part (median, clipping, rejection): pure tensors
- ``liveness.py``   whether an expected peer can be reached now (dials refused or in backoff)
"""
