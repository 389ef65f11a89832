#!/usr/bin/env bash
# Images arriving while text streams run (CPU, target host): an init-tiny
# model of hidden 1024 and 4 layers at pp 2, with a vision tower of the real
# widths (hidden 1280, 16 heads, MLP 5120) and VISION_LAYERS layers (default
# 2: a 672×672 image then encodes in about 5 s on this 2-core host), served
# three ways:
#   - the tower on stage 0, encoding in the step loop (`--encodes inline`,
#     what m3c did before);
#   - the tower on stage 0, encoding beside the loop (the default);
#   - the tower on an encoder rank of its own (a plan's `vision: {ranks: 1}`).
# Each: STREAMS text streams (3000 tokens max, cancelled at the phase's end)
# alone for ALONE_S seconds, then while IMAGES 672×672 image chats (each its
# own picture) arrive one after another; prints the streams' inter-token gap
# p50/p99/p99.9/max in each phase and each image's latency.
set -euo pipefail
cd "$(dirname "$0")/.."
STREAMS=${STREAMS:-16}
IMAGES=${IMAGES:-8}
ALONE_S=${ALONE_S:-15}
VISION_LAYERS=${VISION_LAYERS:-2}
./scripts/setup.sh >/dev/null
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --locked -q -p m3c -p m3c-runtime
M3C=$PWD/target/release/m3c
PY=$PWD/.venv-serve/bin/python
work=$(mktemp -d "${TMPDIR:-/tmp}/m3c-bench-encoder.XXXXXX")
server=
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

$M3C init-tiny "$work/m" --hidden 1024 --layers 4 --vision-hidden 1280 --vision-heads 16 --vision-mlp 5120 \
  --vision-layers "$VISION_LAYERS" --projector-hidden 1024 --seed 3 >/dev/null
printf 'version: 1\nstages:\n  - layers: "0-1"\n  - layers: "2-3"\n' > "$work/stage0.yaml"
printf 'version: 1\nvision:\n  ranks: 1\nstages:\n  - layers: "0-1"\n  - layers: "2-3"\n' > "$work/rank.yaml"
$M3C compile "$work/stage0.yaml" --model "$work/m" --pp 2 -o "$work/stage0" >/dev/null
$M3C compile "$work/rank.yaml" --model "$work/m" --pp 2 -o "$work/rank" >/dev/null

for mode in "stage0 inline" "stage0 beside" "rank beside"; do
  set -- $mode
  $M3C serve "$work/$1" --model "$work/m" --port 0 --served-model-name m --encodes "$2" --max-model-len 4096 2>"$work/serve.log" &
  server=$!
  base=
  for _ in $(seq 1 600); do
    base=$(grep -o 'http://127.0.0.1:[0-9]*/v1' "$work/serve.log" | head -1 || true)
    [ -n "$base" ] && curl -sf "${base%/v1}/health" >/dev/null && break
    base=
    sleep 0.1
  done
  [ -n "$base" ] || { cat "$work/serve.log" >&2; exit 1; }
  echo "tower: $1, encodes $2: $($PY scripts/bench_serve.py "$base" m images "$STREAMS" "$IMAGES" "$ALONE_S")"
  kill -TERM "$server"; wait "$server" || true; server=
done
