#!/bin/sh
# Healthy: the dht service has written its addresses; a peer has finished a round in the last
# HEALTHY_ROUND_MINUTES (default 10), i.e. it trains and syncs, not just runs.
set -eu
if [ "${1:-peer}" = dht ]; then
    test -s /shared/bootstrap.maddrs
else
    test -n "$(find "/ckpt/$(hostname)/metrics.jsonl" -mmin "-${HEALTHY_ROUND_MINUTES:-10}" 2>/dev/null)"
fi
