"""What runs in the averager process: hivemind's DecentralizedAverager, made exact, robust and shareable.

- ``averager.py``   ``SwarmAverager``: round keys, the consensus gate over the gathered contributions, the all-reduce
- ``mortal.py``     the peer's waits on the averager's process, which end as soon as it is found dead
- ``allreduce.py``  the exact butterfly all-reduce (bit-identical results or a clean failure): the sender's half
- ``reducing.py``   its reducer's half: each sender's stream answered, a broken one resumed, a late or wrong one dropped
- ``parts.py``      its parts: sized, encoded by our codecs, summed over every sender (robustly, idempotently)
- ``robust.py``     robust aggregation of one part (median, clipping, rejection): pure tensors
- ``bans.py``       offences counted across rounds, and bans
- ``leaders.py``    whom a round's matchmaking asks to lead its group: the expected peers our records name
- ``liveness.py``   whether an expected peer can be reached now (dials refused or in backoff), and the probe
- ``inuse.py``      the peers we stream with now, whose connections an unanswered ping leaves open
- ``sharing.py``    state sharing: snapshots served by slice, striped downloads from several donors
- ``results.py``    a cross-group round's result, served by its delegates to their groupmates
- ``striping.py``   one download from many donors at once, a donor that fails dropped (both downloads above)
- ``pacing.py``     the process's bulk sends spaced below ``--max-upload``, so control messages never queue behind
                    a round; and what to tell a user whose host lets sockets queue without bound
"""
