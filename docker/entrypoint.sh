#!/bin/sh
# Container entrypoint: runs `kvconnect ARGS...` (default CMD: `serve`).
#
# When the side channel binds a wildcard (the images bind 0.0.0.0) and nothing says which address peers
# should dial, kvconnect refuses to start. Here that gap is filled with the container's own address, as
# Docker and Kubernetes write it into /etc/hosts. The compose file and the Kubernetes manifests set
# KVCONNECT_ADVERTISE_HOST explicitly (static address; pod IP through the downward API), so this only
# matters for a bare `docker run`. A loopback or unknown answer is left alone: kvconnect then says what to set.
set -eu
case "${KVCONNECT_SIDE_CHANNEL_HOST:-}" in
  0.0.0.0 | :: | "[::]" | "*")
    if [ -z "${KVCONNECT_ADVERTISE_HOST:-}" ]; then
      addr=$(getent hosts "$(hostname)" 2>/dev/null | awk '{ print $1; exit }') || addr=""
      case "$addr" in
        "" | 127.* | ::1) ;;
        *) KVCONNECT_ADVERTISE_HOST=$addr; export KVCONNECT_ADVERTISE_HOST ;;
      esac
    fi
    ;;
esac
exec kvconnect "$@"
