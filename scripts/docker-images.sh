#!/usr/bin/env bash
# Builds the tokenmesh Docker images without pulling anything:
#   1. a minimal Debian bookworm (debootstrap --variant=minbase) with the
#      packages of deploy/base-packages.txt, imported as tokenmesh-base:<tag>,
#      where <tag> hashes the package list and this script; skipped when that
#      image exists, and the root filesystem is cached in target/docker-base/;
#   2. tokenmesh:local, from deploy/Dockerfile's runtime stage on that base with
#      the prebuilt release binaries from target/release (no cargo build here).
# Usage: scripts/docker-images.sh [--base-only]
# Env: TOKENMESH_IMAGE (default tokenmesh:local), DEBIAN_MIRROR.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${TOKENMESH_IMAGE:-tokenmesh:local}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
BINARIES=(tokenmesh-router tokenmesh-worker tokenmesh-certs meshctl)
# the control plane is copied when it has been built
OPTIONAL=(tokenmesh-control)

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

packages=$(grep -v '^\s*#' deploy/base-packages.txt | grep -v '^\s*$' | sort | paste -sd, -)
tag=$( (echo "$packages"; echo "$MIRROR"; sed -n '/^# --- base recipe/,/^# --- end base recipe/p' "$0") \
  | sha256sum | cut -c1-12)
BASE=tokenmesh-base:$tag

t0=$(now)
if docker image inspect "$BASE" >/dev/null 2>&1; then
  echo "base image $BASE exists (packages: $packages)"
else
  # --- base recipe
  command -v debootstrap >/dev/null || {
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
  }
  cache=target/docker-base
  rootfs=$cache/rootfs-$tag
  if [ ! -f "$rootfs/.complete" ]; then
    as_root rm -rf "$rootfs"
    mkdir -p "$cache"
    echo "debootstrap bookworm ($packages) into $rootfs"
    as_root debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$MIRROR" \
      >"$cache/debootstrap-$tag.log" 2>&1 || {
        tail -20 "$cache/debootstrap-$tag.log" >&2
        echo "debootstrap failed; full log: $cache/debootstrap-$tag.log" >&2
        exit 1
      }
    # what a container never needs: package caches and lists, docs, man pages
    as_root rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
      "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/locale/*
    as_root touch "$rootfs/.complete"
  fi
  as_root tar -C "$rootfs" --exclude=./.complete --exclude=./proc/* --exclude=./sys/* --exclude=./dev/* -c . \
    | docker import --change 'CMD ["/bin/bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - "$BASE" >/dev/null
  # --- end base recipe
  echo "base image $BASE built"
fi
echo "base image: $(took "$t0") s"
[ "${1:-}" = "--base-only" ] && exit 0

t1=$(now)
ctx=target/docker-context
rm -rf "$ctx"
mkdir -p "$ctx/target/release" "$ctx/deploy"
for b in "${BINARIES[@]}"; do
  if [ ! -x "target/release/$b" ]; then
    echo "target/release/$b is missing: build first (cargo build --release --workspace --locked)" >&2
    exit 1
  fi
  ln "target/release/$b" "$ctx/target/release/$b" 2>/dev/null || cp "target/release/$b" "$ctx/target/release/$b"
done
for b in "${OPTIONAL[@]}"; do
  if [ -x "target/release/$b" ]; then
    ln "target/release/$b" "$ctx/target/release/$b" 2>/dev/null || cp "target/release/$b" "$ctx/target/release/$b"
  else
    echo "note: target/release/$b not built; the image has no $b" >&2
  fi
done
cp deploy/entrypoint.sh "$ctx/deploy/"
# deploy/Dockerfile's runtime stage, verbatim, with the prebuilt binaries as its
# `binaries` stage; the classic builder (no BuildKit needed) builds it from a
# context that holds only the binaries and the entrypoint.
{
  echo "ARG BASE"
  echo "FROM scratch AS binaries"
  echo "LABEL org.tokenmesh.stage=binaries"
  echo "COPY target/release/ /out/"
  sed -n '/^# --- runtime/,$p' deploy/Dockerfile
} >"$ctx/Dockerfile"
old=$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)
DOCKER_BUILDKIT=0 docker build -q --build-arg BASE="$BASE" -t "$IMAGE" "$ctx" >"$ctx.log" 2>&1 || {
  cat "$ctx.log" >&2
  exit 1
}
# the image this one replaces would be left dangling: remove it unless in use
new=$(docker image inspect -f '{{.Id}}' "$IMAGE")
if [ -n "$old" ] && [ "$old" != "$new" ]; then docker rmi "$old" >/dev/null 2>&1 || true; fi
# and so would the classic builder's image of the binaries stage
docker image prune -f --filter label=org.tokenmesh.stage=binaries >/dev/null
echo "image $IMAGE built on $BASE: $(took "$t1") s"
