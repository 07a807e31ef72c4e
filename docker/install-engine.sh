#!/usr/bin/env bash
# What the Docker tests need, installed when missing (`make test` and CI run this first; it needs root, and does
# nothing without it): Debian's docker.io (dockerd and a docker client; rootlesskit, uidmap and slirp4netns for its
# rootless mode), debootstrap (the CPU stand-in's base image, `make image-base-cpu`), and the Docker Compose v2
# plugin for `docker compose ... config`; and Debian's chromium, for the browser test of the MLflow UI
# (tests/test_ui_browser.py); and slurm-wlm, munge and iproute2 for the Slurm tests' cluster (tests/test_slurm.py).
# Debian 12 ships only Compose v1, so the plugin comes from Debian 13's docker-compose
# package: one Go binary that needs only libc, downloaded with its own apt source list (verified against Debian's
# archive keys) and unpacked, not installed.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
    echo "docker/install-engine.sh: not root, nothing installed (the Docker tests start their own engine as root)"
    exit 0
fi

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v chromium >/dev/null || missing+=(chromium)  # tests/test_ui_browser.py: the MLflow UI in a real browser
# Rootless Docker (tests/test_mlflow_run.py runs `mlflow run .` on an engine of the test user's own): rootlesskit,
# the uid maps (newuidmap) and the user-mode network stack its dockerd-rootless.sh uses.
command -v rootlesskit >/dev/null || missing+=(rootlesskit)
command -v newuidmap >/dev/null || missing+=(uidmap)
command -v slirp4netns >/dev/null || missing+=(slirp4netns)
# tests/test_slurm.py: a two-node Slurm cluster (tests/slurm_cluster.py: munged, slurmctld, two slurmd in network
# namespaces, which iproute2's `ip` creates)
command -v slurmctld >/dev/null || missing+=(slurm-wlm)
command -v munged >/dev/null || missing+=(munge)
command -v ip >/dev/null || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# slirp4netns opens /dev/net/tun as the rootless engine's user: Debian's udev makes it 0666, some container hosts
# create it 0600 (root's alone), which only root's engine can use.
if [ -c /dev/net/tun ] && [ "$(stat -c %a /dev/net/tun)" = 600 ]; then
    chmod 666 /dev/net/tun
fi

plugins=/usr/local/lib/docker/cli-plugins
if ! docker compose version >/dev/null 2>&1; then
    work=$(mktemp -d)
    chmod 755 "$work"  # apt downloads as its own user, _apt
    trap 'rm -rf "$work"' EXIT
    echo "deb http://deb.debian.org/debian trixie main" > "$work/trixie.list"
    mkdir -p "$work/lists/partial"
    apt=(apt-get -q -o "Dir::Etc::SourceList=$work/trixie.list" -o Dir::Etc::SourceParts=- \
         -o "Dir::State::Lists=$work/lists")
    "${apt[@]}" update
    (cd "$work" && "${apt[@]}" download docker-compose)
    dpkg-deb -x "$work"/docker-compose_*.deb "$work/unpacked"
    install -D -m 755 "$work/unpacked/usr/libexec/docker/cli-plugins/docker-compose" "$plugins/docker-compose"
fi
docker compose version
