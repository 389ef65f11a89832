#!/usr/bin/env bash
# m3c benchmarks (CPU, target host). Prints one table:
#   - compile time of the real MiniMax-M3 config at pp = 4 (no weights needed);
#   - prefill and decode tokens/s of the tiny fixture and of a larger
#     init-tiny model (hidden 1024, 8 layers) at pp = 1 and pp = 2, for one
#     prompt and for 4 prompts at once (micro-batches in flight together).
#   - a 512-token prompt on the hidden-1024 model beside transformers' f32
#     on the same checkpoint (scripts/bench-transformers.sh; skipped with
#     NO_REFERENCE=1);
#   - the host linears alone at the real widths (m3c bench-kernels): GFLOP/s
#     at 512 rows against the measured FMA peak, and weight GB/s at 1 row.
# Each figure is the median of RUNS runs (default 3). Times come from the
# first stage's own clock ("m3c timing" line): prefill = until every prompt's
# first token is back; decode = the rest.
set -euo pipefail
RUNS=${RUNS:-3}
# shellcheck source=scripts/bench-common.sh
. "$(dirname "$0")/bench-common.sh"

t0=$(date +%s.%N)
$M3C compile --model configs/minimax-m3.config.json --pp 4 -o "$work/m3" >/dev/null
t1=$(date +%s.%N)
compile_s=$(awk "BEGIN {printf \"%.1f\", $t1 - $t0}")

$M3C init-tiny "$work/h1024" --hidden 1024 --layers 8 --seed 1 >/dev/null
prompt() { seq -s, 1 "$1"; }

printf '%-34s %4s %8s %14s %14s\n' "model" "pp" "prompts" "prefill tok/s" "decode tok/s"
for model in tests/fixtures/tiny-m3 "$work/h1024"; do
  name=$(basename "$model")
  [ "$name" = h1024 ] && name="init-tiny hidden 1024, 8 layers"
  for pp in 1 2; do
    $M3C compile --model "$model" --pp $pp -o "$work/out" >/dev/null
    for np in 1 4; do
      args=()
      for i in $(seq 1 $np); do args+=(--prompt-ids "$(prompt 128)"); done
      pre=(); dec=()
      for r in $(seq 1 "$RUNS"); do
        line=$($M3C run "$work/out" --model "$model" "${args[@]}" --max-new-tokens 32 2>&1 >/dev/null | grep 'm3c timing')
        pre+=("$(echo "$line" | sed -E 's/.*prefill [0-9]+ tokens in [0-9.]+ ms \(([0-9.]+) tok\/s\).*/\1/')")
        dec+=("$(echo "$line" | sed -E 's/.*decode [0-9]+ tokens in [0-9.]+ ms \(([0-9.]+) tok\/s\).*/\1/')")
      done
      printf '%-34s %4s %8s %14s %14s\n' "$name" "$pp" "$np" \
        "$(printf '%s\n' "${pre[@]}" | median)" "$(printf '%s\n' "${dec[@]}" | median)"
    done
  done
done
echo
long=$(python3 -c "print(','.join(str(i % 400 + 3) for i in range(512)))")
$M3C compile --model "$work/h1024" --pp 1 -o "$work/out" >/dev/null
pre=(); dec=()
for r in $(seq 1 "$RUNS"); do
  line=$($M3C run "$work/out" --model "$work/h1024" --prompt-ids "$long" --max-new-tokens 33 --ignore-eos 2>&1 >/dev/null | grep 'm3c timing')
  pre+=("$(echo "$line" | sed -E 's/.*\(([0-9.]+) tok\/s\); decode.*/\1/')")
  dec+=("$(echo "$line" | sed -E 's/.*decode [0-9]+ tokens in [0-9.]+ ms \(([0-9.]+) tok\/s\).*/\1/')")
done
m3c_pre=$(printf '%s\n' "${pre[@]}" | median)
m3c_dec=$(printf '%s\n' "${dec[@]}" | median)
printf '\n%-44s %14s %14s\n' "512-token prompt, hidden 1024, 8 layers, pp 1" "prefill tok/s" "decode tok/s"
printf '%-44s %14s %14s\n' "m3c (f32 activations)" "$m3c_pre" "$m3c_dec"
if [ -z "${NO_REFERENCE:-}" ]; then
  read -r _ ref_pre _ ref_dec < <(RUNS=$RUNS scripts/bench-transformers.sh "$work/h1024" 512)
  printf '%-44s %14s %14s\n' "transformers 5.24, torch 2.15, f32" "$ref_pre" "$ref_dec"
  printf '%-44s %14s %14s\n' "m3c / transformers" "$(awk "BEGIN {printf \"%.2fx\", $m3c_pre / $ref_pre}")" \
    "$(awk "BEGIN {printf \"%.2fx\", $m3c_dec / $ref_dec}")"
fi
echo
$M3C bench-kernels
echo
echo "compile, real MiniMax-M3 config (bf16, 60 layers), pp = 4, target host: ${compile_s} s"
echo "machine: $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
