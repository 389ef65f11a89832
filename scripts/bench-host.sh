#!/usr/bin/env bash
# m3c's host (CPU) prefill and decode against transformers' f32, and long
# prompts, in one run (issue 55's table):
#   - the CPU: model, cores, vector and matrix features, the FMA peak with
#     the kernels' 8-wide vectors and with the widest the CPU has;
#   - model A (init-tiny --hidden 1024 --layers 8): prefill of 128 and 512
#     tokens and decode, m3c beside transformers 5.24 (f32,
#     scripts/bench-transformers.sh; NO_REFERENCE=1 leaves it out);
#   - model B (init-tiny --hidden 256 --layers 8, MSA blocks of 128, top 16,
#     64k positions): prefill of 4,096 tokens beside transformers, and m3c
#     alone at 16,384 and 32,768 (LONG="16384" takes fewer);
#   - where perf works, the 16k prefill's time by kernel: MSA's index scores,
#     its block selection and sparse attention, the full-attention layers,
#     the linears, the MoE's routing and experts, the rest.
# Each m3c figure is the median of RUNS runs (default 3; the long prompts
# run once). Times come from the first stage's own clock (`m3c timing`).
# CPU=native builds m3c for this CPU (16-lane linears where it has AVX-512;
# the same bits) instead of the portable x86-64-v3; REF_ISA=avx2 keeps the
# reference to AVX2 (scripts/bench-transformers.sh).
set -euo pipefail
RUNS=${RUNS:-3}
LONG=${LONG:-16384 32768}
CPU=${CPU:-x86-64-v3}
# shellcheck source=scripts/bench-common.sh
. "$(dirname "$0")/bench-common.sh"

flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|avx512_fp16|amx_bf16|amx_int8|amx_tile)$' | tr '\n' ' ')
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores; $flags"
$M3C bench-kernels --peak-only
case " $flags " in *" avx512f "*) $M3C bench-kernels --peak-only --cpu x86-64-v4 ;; esac
echo

ids() { python3 -c "import sys; print(','.join(str(i % 400 + 3) for i in range(int(sys.argv[1]))))" "$1"; }
# m3c's prefill and decode tok/s (medians of RUNS) for a prompt of N tokens.
m3c_rates() {
  local out=$1 model=$2 n=$3 runs=$4 pre=() dec=() line
  ids "$n" >"$work/prompt.txt"
  for _ in $(seq 1 "$runs"); do
    line=$($M3C run "$out" --model "$model" --prompts "$work/prompt.txt" --max-new-tokens 33 --ignore-eos 2>&1 >/dev/null | grep 'm3c timing')
    pre+=("$(echo "$line" | sed -E 's/.*prefill [0-9]+ tokens in [0-9.]+ ms \(([0-9.]+) tok\/s\).*/\1/')")
    dec+=("$(echo "$line" | sed -E 's/.*decode [0-9]+ tokens in [0-9.]+ ms \(([0-9.]+) tok\/s\).*/\1/')")
  done
  echo "$(printf '%s\n' "${pre[@]}" | median) $(printf '%s\n' "${dec[@]}" | median)"
}
row() { printf '%-46s %14s %14s %14s %14s\n' "$@"; }
ratio() { awk "BEGIN {printf \"%.2fx\", $1 / $2}"; }

$M3C init-tiny "$work/A" --hidden 1024 --layers 8 --seed 1 >/dev/null
$M3C init-tiny "$work/B" --hidden 256 --layers 8 --seed 1 >/dev/null
python3 - "$work/B/config.json" <<'PY'
import json, sys
path = sys.argv[1]
c = json.load(open(path))
t = c["text_config"]
t["max_position_embeddings"] = 65536
t["sparse_attention_config"].update(sparse_block_size=128, sparse_topk_blocks=16)
json.dump(c, open(path, "w"), indent=1)
PY
echo "m3c built with --cpu $CPU; reference ISA: ${REF_ISA:-torch default}"
row "case (pp 1, f32 activations)" "m3c prefill" "ref prefill" "m3c decode" "ref decode"
for spec in "A 128" "A 512" "B 4096"; do
  read -r m n <<<"$spec"
  $M3C compile --model "$work/$m" --pp 1 --cpu "$CPU" -o "$work/out$m" >/dev/null
  read -r pre dec < <(m3c_rates "$work/out$m" "$work/$m" "$n" "$RUNS")
  ref_pre="-" ref_dec="-"
  if [ -z "${NO_REFERENCE:-}" ]; then
    read -r _ ref_pre _ ref_dec < <(RUNS=$RUNS scripts/bench-transformers.sh "$work/$m" "$n")
  fi
  row "$m: $n-token prompt (tok/s)" "$pre" "$ref_pre" "$dec" "$ref_dec"
  if [ "$ref_pre" != "-" ]; then
    row "  m3c / transformers" "$(ratio "$pre" "$ref_pre")" "" "$(ratio "$dec" "$ref_dec")" ""
  fi
done
echo
base=$(m3c_rates "$work/outB" "$work/B" 4096 1 | awk '{print 4096 / $1}')
printf '%-46s %14s %14s\n' "B: long prompts, m3c alone" "prefill s" "x 4,096's"
printf '%-46s %14.1f %14s\n' "  4,096 tokens" "$base" "1.0"
for n in $LONG; do
  s=$(m3c_rates "$work/outB" "$work/B" "$n" 1 | awk -v n="$n" '{print n / $1}')
  printf '%-46s %14.1f %14.1f\n' "  $n tokens" "$s" "$(awk "BEGIN {print $s / $base}")"
done

# The 16k prefill by kernel, where perf may sample this process's children.
if command -v perf >/dev/null && perf record -q -o "$work/probe.data" -- true 2>/dev/null; then
  ids 16384 >"$work/prompt.txt"
  perf record -q -F 499 -o "$work/perf.data" -- "$M3C" run "$work/outB" --model "$work/B" --prompts "$work/prompt.txt" --max-new-tokens 1 >/dev/null 2>&1
  echo
  echo "16,384-token prefill of B by kernel (perf samples of the stage):"
  perf report -i "$work/perf.data" --no-children --sort sym --stdio 2>/dev/null | python3 -c '
import re, sys
parts = {}
order = ["MSA index scores", "MSA selection + sparse attention", "full attention", "linears", "MoE routing and experts", "norms, rope, activations", "the rest"]
for line in sys.stdin:
    m = re.match(r"\s*([0-9.]+)%\s+\[.\]\s+(\S+)", line)
    if not m:
        continue
    share, sym = float(m.group(1)), m.group(2)
    if "_msa_" in sym:
        # The MSA kernel runs two parallel phases per pass: the first scores, the second selects and attends.
        part = "MSA selection + sparse attention" if sym.endswith(".1") else "MSA index scores"
    elif sym.startswith("m3c_attention"):
        part = "full attention"
    elif sym.startswith("m3c_linear"):
        part = "linears"
    elif sym.startswith(("m3c_router", "m3c_routed", "m3c_swiglu", "m3c_scatter")):
        part = "MoE routing and experts"
    elif sym.startswith(("m3c_rms", "m3c_head_norm", "m3c_add", "m3c_gelu", "m3c_bias")):
        part = "norms, rope, activations"
    else:
        part = "the rest"
    parts[part] = parts.get(part, 0.0) + share
for p in order:
    print(f"  {p:<40} {parts.get(p, 0.0):5.1f} %")
'
fi
