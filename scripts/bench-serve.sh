#!/usr/bin/env bash
# m3c serve under load (CPU, target host): an init-tiny model with
# MiniMax-M3's structure (hidden 1024, 8 layers) at pp = 1 and pp = 2,
# served and driven by scripts/bench_serve.py at concurrency 1, 4 and 16
# (REQUESTS streaming completions of MAX_TOKENS tokens each, temperature 0.8,
# EOS ignored). Prints output tok/s, TTFT and ITL p50/p99 and each stage's
# busy fraction, and compares concurrency 16 with `m3c run` generating the
# same 16 prompts offline (the goal: serving reaches at least 0.8x).
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${REQUESTS:-16}
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
  dec_ms=$(sed -E 's/.*decode [0-9]+ steps in ([0-9.]+) ms.*/\1/' <<<"$timing")
  offline=$(awk "BEGIN {printf \"%.1f\", 16 * $MAX_TOKENS / (($pre_ms + $dec_ms) / 1000)}")
  $M3C serve "$work/pp$pp" --model "$work/h1024" --port 0 --served-model-name h1024 --max-batch 16 2>"$work/serve.log" &
  server=$!
  base=
  for _ in $(seq 1 600); do
    base=$(grep -o 'http://127.0.0.1:[0-9]*/v1' "$work/serve.log" | head -1 || true)
    [ -n "$base" ] && curl -sf "${base%/v1}/health" >/dev/null && break
    sleep 0.1
  done
  [ -n "$base" ] || { cat "$work/serve.log" >&2; exit 1; }
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
  kill -TERM "$server"; wait "$server" || true; server=
done
