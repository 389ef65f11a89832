#!/usr/bin/env bash
# Speculative decoding's benchmark (CPU, target host): decode tokens/s with
# and without n-gram prompt lookup (`--speculative-config`), greedy, at
# pp = 1 and 2, for 1 and for 8 prompts at once, on the tiny fixture and on
# an init-tiny model of hidden 1024 and 8 layers; beside each, the mean
# acceptance length (vLLM's: 1 + accepted / verify steps). The prompts are
# a list said four times over ("repeat this list"), so lookup finds drafts.
# Each figure is the median of RUNS runs (default 3), plain and speculative
# runs alternating so that both see the same machine. The output is the
# same bytes either way (checked here on every pair). How many drafts each
# step takes is the engine's choice (its cost model): `drafts/verify` is
# the mean it chose where it drafted, `verify steps` how many steps did.
# `K=1`..`K=3` are the same runs with every step drafting that many
# (M3C_SPEC_FIXED_K, vLLM's behaviour): the speed-up each fixed K gives,
# which the engine's choice should match where drafts pay and beat where
# they do not. FIXED="" leaves them out.
#
# EXTRA="--repetition-penalty 0.5" adds flags to every run: a penalty below
# 1 favours tokens already seen, so the output repeats itself and lookup's
# drafts are kept more often (acceptance is high), which is where a fixed K
# pays and the engine's choice should match the best of them.
#
# METHOD=eagle3 measures the EAGLE3 head instead: tiny-m3 compiled with
# tests/fixtures/eagle3-tiny (the draft trained for it), K = 3, on the same
# prompts and on the golden's held-out path.
set -euo pipefail
METHOD=${METHOD:-ngram}
RUNS=${RUNS:-3}
NEW=${NEW:-128}
FIXED=${FIXED-1 2 3}
SPEC=${SPEC:-'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'}
# shellcheck source=scripts/bench-common.sh
. "$(dirname "$0")/bench-common.sh"

models=(tests/fixtures/tiny-m3 "$work/h1024")
compile_flags=()
if [ "$METHOD" = eagle3 ]; then
  SPEC="{\"method\": \"eagle3\", \"model\": \"$PWD/tests/fixtures/eagle3-tiny\", \"num_speculative_tokens\": 3}"
  # The head is compiled into the last stage; its draft is tiny-m3's.
  compile_flags=(--speculative-config "$SPEC")
  models=(tests/fixtures/tiny-m3)
else
  $M3C init-tiny "$work/h1024" --hidden 1024 --layers 8 --seed 1 >/dev/null
fi
# MODELS="DIR ..." measures only those checkpoints.
if [ -n "${MODELS:-}" ]; then read -ra models <<<"$MODELS"; fi
# Prompt i: 16 ids from i on, four times over.
prompt() { python3 -c "import sys; i = int(sys.argv[1]); print(','.join(str(3 + (i * 37 + k) % 400) for _ in range(4) for k in range(16)))" "$1"; }
decode_rate() { sed -E 's/.*decode [0-9]+ tokens in [0-9.]+ ms \(([0-9.]+) tok\/s\).*/\1/'; }

printf 'speculative config: %s; %s new tokens per prompt, greedy\n' "$SPEC" "$NEW"
printf '%-34s %4s %8s %14s %14s %9s %11s %14s %13s' "model" "pp" "prompts" "plain tok/s" "$METHOD tok/s" "speed-up" "accept len" "drafts/verify" "verify steps"
for f in $FIXED; do printf ' %8s' "K=$f"; done
printf '\n'
for model in "${models[@]}"; do
  name=$(basename "$model")
  [ "$name" = h1024 ] && name="init-tiny hidden 1024, 8 layers"
  for pp in 1 2; do
    $M3C compile --model "$model" --pp $pp -o "$work/out" "${compile_flags[@]}" >/dev/null
    for np in 1 8; do
      args=(--max-new-tokens "$NEW" --ignore-eos)
      if [ -n "${EXTRA:-}" ]; then read -ra extra <<<"$EXTRA"; args+=("${extra[@]}"); fi
      for i in $(seq 1 $np); do args+=(--prompt-ids "$(prompt "$i")"); done
      plain=(); spec=(); len=(); k=(); steps=()
      declare -A fixed=()
      for r in $(seq 1 "$RUNS"); do
        $M3C run "$work/out" --model "$model" "${args[@]}" >"$work/plain.out" 2>"$work/plain.err"
        $M3C run "$work/out" --model "$model" "${args[@]}" --speculative-config "$SPEC" >"$work/spec.out" 2>"$work/spec.err"
        cmp -s "$work/plain.out" "$work/spec.out" || { echo "speculation changed the output ($name, pp $pp, $np prompts)" >&2; exit 1; }
        plain+=("$(grep 'm3c timing' "$work/plain.err" | decode_rate)")
        spec+=("$(grep 'm3c timing' "$work/spec.err" | decode_rate)")
        len+=("$(grep -o 'mean acceptance length [0-9.]*' "$work/spec.err" | awk '{print $4}' || echo 1)")
        line=$(grep 'm3c spec:' "$work/spec.err" || echo 'm3c spec: 0 verify step(s), 0 draft tokens')
        steps+=("$(echo "$line" | awk '{print $3}')")
        k+=("$(echo "$line" | awk '{printf "%.2f", ($3 > 0 ? $6 / $3 : 0)}')")
        for f in $FIXED; do
          M3C_SPEC_FIXED_K=$f $M3C run "$work/out" --model "$model" "${args[@]}" --speculative-config "$SPEC" >"$work/fixed.out" 2>"$work/fixed.err"
          cmp -s "$work/plain.out" "$work/fixed.out" || { echo "fixed K=$f changed the output" >&2; exit 1; }
          fixed[$f]+="$(grep 'm3c timing' "$work/fixed.err" | decode_rate) "
        done
      done
      p=$(printf '%s\n' "${plain[@]}" | median)
      s=$(printf '%s\n' "${spec[@]}" | median)
      printf '%-34s %4s %8s %14s %14s %9s %11s %14s %13s' "$name" "$pp" "$np" "$p" "$s" \
        "$(awk "BEGIN {printf \"%.2fx\", $s / $p}")" "$(printf '%s\n' "${len[@]}" | median)" \
        "$(printf '%s\n' "${k[@]}" | median)" "$(printf '%s\n' "${steps[@]}" | median)"
      for f in $FIXED; do
        printf ' %8s' "$(awk "BEGIN {printf \"%.2fx\", $(printf '%s\n' ${fixed[$f]} | median) / $p}")"
      done
      printf '\n'
    done
  done
done
