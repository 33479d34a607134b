#!/usr/bin/env bash
# Make this Debian (bookworm) machine run the two-node compose demo with rootful podman, offline from any
# image registry. Idempotent: a step whose result is already there is skipped. Needs root.
#
#   bash scripts/podman_host.sh host   # podman 4.3 and what it needs, from Debian's archive; its settings
#   bash scripts/podman_host.sh base   # the base image, made with debootstrap (no registry needed)
#   bash scripts/podman_host.sh all    # both (the default)
#
# Settings written (a drop-in, /etc/containers/containers.conf.d/50-kvconnect.conf, nothing else touched):
#   default_ulimits  nofile 20000, nproc 32768: podman's defaults raise the containers' rlimits above what
#                    root may set on some hosts ("setrlimit ... Operation not permitted" at start)
#   runtime = runc   crun 1.8 (bookworm) refuses hybrid cgroup hierarchies; runc runs on both
#   network_backend = netavark  (with aardvark-dns: DNS by container name on user networks; podman 4.3 would
#                    otherwise fall back to CNI wherever it finds CNI configuration, and the CNI plugins are
#                    not installed)
# Rootful only: rootless podman falls back to vfs storage and cannot open /dev/net/tun.
#
# The base image, BASE_IMAGE (default localhost/kvconnect-base:bookworm): Debian bookworm (minbase) with
# python3 (3.11), python3-venv and ca-certificates, imported with `podman import`. The Dockerfiles take it as
# `--build-arg PYTHON_IMAGE=...`; where a registry is reachable, their default python image works instead.
# No certificate of this host goes into it (image builds mount the host's CA bundle only while they run:
# kvconnect/harness/images.py).
set -euo pipefail
BASE_IMAGE=${BASE_IMAGE:-localhost/kvconnect-base:bookworm}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=(podman netavark aardvark-dns runc conmon catatonit uidmap slirp4netns fuse-overlayfs debootstrap
  iptables nftables)
DROPIN=/etc/containers/containers.conf.d/50-kvconnect.conf

say() { echo "podman_host: $*" >&2; }

need_root() {
  [ "$(id -u)" = 0 ] || { say "needs root (rootful podman; apt-get; debootstrap)"; exit 1; }
}

host() {
  need_root
  local missing=()
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  mkdir -p "$(dirname "$DROPIN")"
  local want
  want=$(printf '%s\n' '# written by kvconnect scripts/podman_host.sh' '[containers]' \
    'default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]' '' '[engine]' 'runtime = "runc"' \
    '' '[network]' 'network_backend = "netavark"')
  if [ ! -f "$DROPIN" ] || [ "$(cat "$DROPIN")" != "$want" ]; then
    printf '%s\n' "$want" > "$DROPIN"
    say "wrote $DROPIN"
  fi
  # the settings took
  local got
  got=$(podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.NetworkBackend}}')
  [ "$got" = "runc netavark" ] || { say "podman uses $got, not runc netavark: is $DROPIN read?"; exit 1; }
}

base() {
  need_root
  if podman image exists "$BASE_IMAGE"; then
    say "$BASE_IMAGE is there"
  else
    local root
    root=$(mktemp -d /var/tmp/kvconnect-rootfs.XXXXXX)
    trap 'rm -rf "$root"' RETURN
    say "debootstrap bookworm (minbase) into $root"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$DEBIAN_MIRROR" \
      >/dev/null
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | podman import \
      --change 'CMD ["/bin/bash"]' \
      --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      - "$BASE_IMAGE" >/dev/null
    say "imported $BASE_IMAGE"
  fi
  # the base runs: a container starts with the configured rlimits and runtime, and its Python is 3.11+
  podman run --rm --network none "$BASE_IMAGE" python3 -c 'import sys, venv; assert sys.version_info >= (3, 11)'
}

case "${1:-all}" in
  host) host ;;
  base) base ;;
  all) host; base ;;
  *) echo "usage: $0 {host|base|all}" >&2; exit 2 ;;
esac
