#!/bin/sh
# Container entrypoint: runs `kvconnect ARGS...` when ARGS start with a kvconnect subcommand or an option
# (the kvconnect images' CMD is `serve`; `proxy` runs the proxy), any other command as given (the vLLM
# image's `python -m vllm.entrypoints.openai.api_server ...`), after the same address set-up.
#
# When the side channel binds a wildcard (the images bind 0.0.0.0) and nothing says which address peers
# should dial, kvconnect refuses to start. Here that gap is filled with the container's own address, as
# Docker and Kubernetes write it into /etc/hosts. The compose file and the Kubernetes manifests set
# KVCONNECT_ADVERTISE_HOST explicitly (the service's DNS name; the pod IP through the downward API), so
# this only matters for a bare `docker run`. A loopback or unknown answer is left alone: kvconnect then
# says what to set. (A side channel off loopback also needs KVCONNECT_SECRET: docker/README.md.)
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
case "${1:-}" in
  "" | -* | serve | proxy | demo | bench | bench-vllm | verdict) exec kvconnect "$@" ;;  # kvconnect/cli.py
  *) exec "$@" ;;
esac
