#!/usr/bin/env bash
# m3c serve under load (CPU, target host): an init-tiny model with
# MiniMax-M3's structure (hidden 1024, 8 layers) at pp = 1 and pp = 2,
# served and driven by scripts/bench_serve.py at concurrency 1, 4 and 16
# (REQUESTS streaming completions of MAX_TOKENS tokens each, temperature 0.8,
# EOS ignored). Prints output tok/s, TTFT and ITL p50/p99 and each stage's
# busy fraction, and compares concurrency 16 with `m3c run` generating the
# same 16 prompts offline (the goal: serving reaches at least 0.8x).
#
# Then the KV pool's two workloads (WORKLOADS="load kv" by default; either
# alone), on an init-tiny model of hidden 512 and 4 layers at pp = 2 (32
# cold prefills of a long prompt take minutes at hidden 1024 on 2 cores):
# - shared prefix: 32 chats at once with one long system prompt (well over
#   8 blocks), each its own question: TTFT p50/p99 and throughput with and
#   without prefix caching (the goal: TTFT p50 at least 4x lower with it);
# - capacity: a fixed pool (twice what one request reserved before paging:
#   its prompt plus max_tokens 4000), 32 requests of max_tokens 4000 that
#   end early on a stop string: sequences in flight and throughput, paged
#   against the old reservation (a batch limit of the 2 reservations the
#   pool held); the goal: at least 4x more in flight.
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${REQUESTS:-16}
WORKLOADS=${WORKLOADS:-"load kv"}
MAX_TOKENS=${MAX_TOKENS:-64}
./scripts/setup.sh >/dev/null
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --locked -q -p m3c -p m3c-runtime
M3C=$PWD/target/release/m3c
PY=$PWD/.venv-serve/bin/python
work=$(mktemp -d "${TMPDIR:-/tmp}/m3c-bench-serve.XXXXXX")
server=
cleanup() { [ -n "$server" ] && kill "$server" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT

# start_server OUT MODEL NAME [FLAGS...]: m3c serve in the background; sets $base.
start_server() {
  local out=$1 model=$2 name=$3
  shift 3
  $M3C serve "$out" --model "$model" --port 0 --served-model-name "$name" "$@" 2>"$work/serve.log" &
  server=$!
  base=
  for _ in $(seq 1 600); do
    base=$(grep -o 'http://127.0.0.1:[0-9]*/v1' "$work/serve.log" | head -1 || true)
    [ -n "$base" ] && curl -sf "${base%/v1}/health" >/dev/null && return 0
    sleep 0.1
  done
  cat "$work/serve.log" >&2
  exit 1
}
stop_server() { kill -TERM "$server"; wait "$server" || true; server=; }

$M3C init-tiny "$work/h1024" --hidden 1024 --layers 8 --seed 1 >/dev/null
# The 16 prompts of the comparison, as m3c run takes them.
$PY - "$work/prompts.jsonl" <<'PY'
import json, sys
sys.path.insert(0, "scripts")
from bench_serve import prompts
with open(sys.argv[1], "w") as f:
    for p in prompts(16):
        f.write(json.dumps({"prompt": p}) + "\n")
PY

if [[ " $WORKLOADS " == *" load "* ]]; then
printf '%-3s %5s %10s %9s %9s %8s %8s  %s\n' pp conc "out tok/s" "TTFT p50" "TTFT p99" "ITL p50" "ITL p99" "stage busy"
for pp in 1 2; do
  $M3C compile --model "$work/h1024" --pp $pp -o "$work/pp$pp" >/dev/null
  # Offline: the same 16 prompts in one m3c run (micro-batches of 16 / pp).
  t0=$(date +%s.%N)
  $M3C run "$work/pp$pp" --model "$work/h1024" --prompts "$work/prompts.jsonl" --max-new-tokens "$MAX_TOKENS" \
    --temperature 0.8 --ignore-eos --micro-batch $(( 16 / pp )) >/dev/null 2>"$work/run.log"
  t1=$(date +%s.%N)
  timing=$(grep 'm3c timing' "$work/run.log")
  pre_ms=$(sed -E 's/.*prefill [0-9]+ tokens in ([0-9.]+) ms.*/\1/' <<<"$timing")
  dec_ms=$(sed -E 's/.*decode [0-9]+ tokens in ([0-9.]+) ms.*/\1/' <<<"$timing")
  offline=$(awk "BEGIN {printf \"%.1f\", 16 * $MAX_TOKENS / (($pre_ms + $dec_ms) / 1000)}")
  start_server "$work/pp$pp" "$work/h1024" h1024 --max-batch 16
  for conc in 1 4 16; do
    out=$($PY scripts/bench_serve.py "$base" h1024 $conc "$REQUESTS" "$MAX_TOKENS")
    $PY - "$out" "$pp" "$conc" "$offline" <<'PY'
import json, sys
r, pp, conc, offline = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
busy = " ".join(f"{k}:{v:.2f}" for k, v in r["busy"].items())
print(f"{pp:<3} {conc:>5} {r['output_tok_s']:>10.1f} {r['ttft_ms_p50']:>8.1f}ms {r['ttft_ms_p99']:>7.1f}ms {r['itl_ms_p50']:>6.2f}ms {r['itl_ms_p99']:>6.2f}ms  {busy}")
if conc == 16:
    print(f"    offline m3c run, same 16 prompts: {offline:.1f} tok/s; serving at 16 = {r['output_tok_s'] / offline:.2f}x")
PY
  done
  stop_server
done
fi

if [[ " $WORKLOADS " == *" kv "* ]]; then
  $M3C init-tiny "$work/h512" --hidden 512 --layers 4 --seed 2 >/dev/null
  $M3C compile --model "$work/h512" --pp 2 -o "$work/kv" >/dev/null
  echo
  echo "Shared prefix (hidden 512, 4 layers, pp 2): 32 chats at once, one long system prompt, 16 tokens each"
  printf '%-16s %9s %9s %10s %12s %9s\n' "prefix caching" "TTFT p50" "TTFT p99" "out tok/s" "prompt tok" "from cache"
  for mode in on off; do
    flags=(--max-batch 32)
    [ $mode = off ] && flags+=(--no-enable-prefix-caching)
    start_server "$work/kv" "$work/h512" h512 "${flags[@]}"
    out=$($PY scripts/bench_serve.py "$base" h512 shared 32 16)
    $PY - "$out" "$mode" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
print(f"{sys.argv[2]:<16} {r['ttft_ms_p50']:>7.0f}ms {r['ttft_ms_p99']:>7.0f}ms {r['output_tok_s']:>10.1f} {r['prompt_tokens']:>12.0f} {100 * r['hit_share']:>8.1f}%")
PY
    stop_server
  done
  echo
  # Twice what one request reserved before paging: a prompt of at most 64
  # tokens plus max_tokens 4000 and the scoring row, in blocks of 4.
  blocks=$(( 2 * ((64 + 4000 + 1 + 3) / 4) ))
  echo "Capacity (hidden 512, 4 layers, pp 2): a pool of $blocks blocks, 32 requests of max_tokens 4000 ending on a stop string"
  printf '%-34s %9s %9s %10s %11s\n' "admission" "peak" "mean" "out tok/s" "tokens/req"
  for mode in paged reserved; do
    # The old reservation admitted as many requests as whole reservations fit: 2.
    mb=64
    [ $mode = reserved ] && mb=2
    start_server "$work/kv" "$work/h512" h512 --kv-blocks $blocks --max-batch $mb
    out=$($PY scripts/bench_serve.py "$base" h512 capacity 32 4000 "${STOP:-e}")
    $PY - "$out" "$mode" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
name = {"paged": "paged (blocks as reached)", "reserved": "reservation (prompt + max_tokens)"}[sys.argv[2]]
print(f"{name:<34} {r['peak_in_flight']:>9.0f} {r['mean_in_flight']:>9.1f} {r['output_tok_s']:>10.1f} {r['mean_tokens']:>11.1f}")
PY
    stop_server
  done
fi
