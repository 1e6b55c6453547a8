#!/bin/sh
# Container entrypoint. Optional WAN shaping with tc netem (needs cap_add NET_ADMIN), then the command
# runs as the unprivileged user peer (uid 1000):
#   dht   -> python -m dht on port 31337, its addresses written to /shared/bootstrap.maddrs
#   peer  -> python -m peer joining BOOTSTRAP_MADDR, or the address the dht service wrote;
#            checkpoint and metrics in /ckpt/<hostname>, so replicas of one service never share one
#   other -> run as given (python -m peer status ..., bash, ...)
# WAN_DELAY_MS, WAN_LOSS_PERCENT and WAN_RATE_MBIT shape everything this container sends on WAN_DEVICE.
set -eu

if [ -n "${WAN_DELAY_MS:-}${WAN_LOSS_PERCENT:-}${WAN_RATE_MBIT:-}" ]; then
    netem=""
    [ -n "${WAN_DELAY_MS:-}" ] && netem="$netem delay ${WAN_DELAY_MS}ms"
    [ -n "${WAN_LOSS_PERCENT:-}" ] && netem="$netem loss ${WAN_LOSS_PERCENT}%"
    [ -n "${WAN_RATE_MBIT:-}" ] && netem="$netem rate ${WAN_RATE_MBIT}mbit"
    # shellcheck disable=SC2086  # $netem is a list of tc arguments
    if ! tc qdisc replace dev "${WAN_DEVICE:-eth0}" root netem $netem; then
        echo "error: WAN shaping ($netem) failed: the container needs cap_add [NET_ADMIN] and a host kernel" \
             "with sch_netem; unset WAN_DELAY_MS, WAN_LOSS_PERCENT and WAN_RATE_MBIT to run unshaped" >&2
        exit 2
    fi
    echo "WAN shaping on ${WAN_DEVICE:-eth0}:$netem" >&2
fi

as_peer() {
    if [ "$(id -u)" = 0 ]; then
        exec setpriv --reuid=1000 --regid=1000 --init-groups -- "$@"
    fi
    exec "$@"
}

role="${1:-peer}"
[ $# -gt 0 ] && shift
case "$role" in
    dht)
        as_peer python -m dht --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity-path /data/bootstrap.key \
            --maddr-file /shared/bootstrap.maddrs "$@"
        ;;
    peer)
        maddr="${BOOTSTRAP_MADDR:-}"
        waited=0
        while [ -z "$maddr" ]; do
            if [ -s /shared/bootstrap.maddrs ]; then
                maddr="$(head -n 1 /shared/bootstrap.maddrs)"
            elif [ "$waited" -ge "${BOOTSTRAP_WAIT_SECONDS:-120}" ]; then
                echo "error: no bootstrap address after ${waited}s: start the dht service, or set BOOTSTRAP_MADDR" >&2
                exit 2
            else
                sleep 1
                waited=$((waited + 1))
            fi
        done
        dir="/ckpt/$(hostname)"
        # --new-run: every replica starts the same way, and whichever comes first creates the run
        as_peer python -m peer --initial-peers "$maddr" --new-run --host-maddrs /ip4/0.0.0.0/tcp/31338 \
            --checkpoint-dir "$dir" --metrics-file "$dir/metrics.jsonl" --quiet "$@"
        ;;
    *)
        as_peer "$role" "$@"
        ;;
esac
