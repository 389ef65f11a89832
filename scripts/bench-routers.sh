#!/usr/bin/env bash
# m3c replicas behind routers (CPU, target host): a multi-tenant
# shared-prefix workload (SYSTEMS system prompts of ~600 tokens x USERS
# users, streaming chats of 4 tokens, CONCURRENCY at a time, shuffled;
# scripts/bench_routers.py) on REPLICAS replicas of an init-tiny model
# (hidden 512, 4 layers, pp 1), through
#   - one replica alone (the hit rate a router should keep),
#   - vllm-router --policy round_robin,
#   - vllm-router --policy cache_aware (token ids from the render routes),
#   - vllm-router --policy kv_aware (fed by m3c's KV-cache events),
#   - one m3c serve --data-parallel-size REPLICAS (m3c's own balancer).
# Every configuration starts fresh replicas (empty caches). Prints, per
# configuration, the prefix cache's hit rate over the replicas and TTFT
# p50/p99. Replicas are processes of this host (the CPU is shared: TTFT
# compares configurations, it is not a replica's own speed).
set -euo pipefail
REPLICAS=${REPLICAS:-2}
SYSTEMS=${SYSTEMS:-8}
USERS=${USERS:-8}
CONCURRENCY=${CONCURRENCY:-16}
"$(dirname "$0")"/setup.sh >/dev/null
# shellcheck source=scripts/bench-common.sh
. "$(dirname "$0")/bench-common.sh"
PY=$PWD/.venv-serve/bin/python
ROUTER=$PWD/.venv-router/bin/vllm-router
pids=()
# The replicas and routers go too, with the work folder.
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_up() { for _ in $(seq 1 900); do curl -sf "$1" >/dev/null && return 0; sleep 0.1; done; echo "not up: $1" >&2; exit 1; }
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }

$M3C init-tiny "$work/m" --hidden 512 --layers 4 --seed 1 >/dev/null
$M3C compile --model "$work/m" --pp 1 -o "$work/out" >/dev/null
block=$(python3 -c "import json; print(json.load(open('$work/out/manifest.json'))['kv_block'])")

# start_replicas N [events]: N fresh replicas; sets roots[] and sources[].
start_replicas() {
  roots=(); sources=()
  for i in $(seq 1 "$1"); do
    local port; port=$(free_port)
    local args=(serve "$work/out" --model "$work/m" --port "$port" --served-model-name m --disable-log-stats)
    if [ "${2:-}" = events ]; then
      local ev; ev=$(free_port)
      args+=(--kv-events-config "{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://127.0.0.1:$ev\"}")
      sources+=(--kv-event-source "http://127.0.0.1:$port=tcp://127.0.0.1:$ev")
    fi
    $M3C "${args[@]}" 2>"$work/replica-$i.log" &
    pids+=($!)
    roots+=("http://127.0.0.1:$port")
  done
  for r in "${roots[@]}"; do wait_up "$r/health"; done
}

# start_router POLICY [ARGS...]: sets $base.
start_router() {
  local port; port=$(free_port)
  local policy=$1; shift
  $ROUTER --worker-urls "${roots[@]}" --policy "$policy" --host 127.0.0.1 --port "$port" --prometheus-port "$(free_port)" "$@" \
    >"$work/router.log" 2>&1 &
  pids+=($!)
  base="http://127.0.0.1:$port/v1"
  wait_up "$base/models"
}

measure() { $PY scripts/bench_routers.py "$1" m "$SYSTEMS" "$USERS" "$CONCURRENCY" "${roots[@]}"; }

printf 'workload: %s system prompts x %s users, concurrency %s, %s replicas (pp 1, init-tiny hidden 512, 4 layers; block %s)\n' \
  "$SYSTEMS" "$USERS" "$CONCURRENCY" "$REPLICAS" "$block"
printf '%-28s %10s %12s %12s %10s\n' "configuration" "hit rate" "TTFT p50 s" "TTFT p99 s" "seconds"
row() { $PY -c "import json,sys; r=json.loads(sys.argv[2]); print(f\"{sys.argv[1]:<28} {r['hit_rate']:>10.3f} {r['ttft_p50']:>12.3f} {r['ttft_p99']:>12.3f} {r['seconds']:>10.1f}\")" "$1" "$2"; }

start_replicas 1
row "one replica alone" "$(measure "${roots[0]}/v1")"
stop_all
for policy in round_robin cache_aware; do
  start_replicas "$REPLICAS"
  start_router "$policy"
  row "vllm-router $policy" "$(measure "$base")"
  stop_all
done
start_replicas "$REPLICAS" events
start_router kv_aware "${sources[@]}" --kv-event-block-size "$block" --kv-event-model m
row "vllm-router kv_aware" "$(measure "$base")"
stop_all
# One front over REPLICAS pipelines: up once every replica says ok.
port=$(free_port)
$M3C serve "$work/out" --model "$work/m" --port "$port" --served-model-name m --disable-log-stats \
  --data-parallel-size "$REPLICAS" 2>"$work/dp.log" &
pids+=($!)
roots=("http://127.0.0.1:$port")
for _ in $(seq 1 900); do
  [ "$(curl -s "${roots[0]}/health" | grep -o '"status":"ok"' | wc -l)" -gt "$REPLICAS" ] && break
  sleep 0.1
done
row "m3c --data-parallel-size $REPLICAS" "$(measure "${roots[0]}/v1")"
stop_all
