"""Local test swarms.

- ``Dockerfile``, ``compose.yml``  one bootstrap node and N peers under docker compose
- ``netns.py``  the same without a docker engine: network namespaces on a bridge, with link cuts,
  partitions and rate limits for tests (``python -m docker.netns``)
"""
