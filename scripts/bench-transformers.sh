#!/usr/bin/env bash
# The public reference on the CPU, for scripts/bench.sh's comparison:
# transformers' MiniMaxM3SparseForConditionalGeneration in f32 on a model
# folder, prefill tok/s of one N-token prompt (median of RUNS, after one
# warm-up) and decode tok/s of 32 greedy steps after it, on every core.
# Installs torch and transformers (the versions the fixtures were made
# with) into .venv-ref/ on first use.
#   scripts/bench-transformers.sh MODEL_DIR [N]     prints: prefill TOK/S decode TOK/S
# REF_ISA=avx2 keeps torch, MKL and oneDNN to AVX2 (an AVX2 host's
# reference, on a machine that has AVX-512).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: scripts/bench-transformers.sh MODEL_DIR [PROMPT_TOKENS]}
n=${2:-512}
RUNS=${RUNS:-3}
venv=.venv-ref
case ${REF_ISA:-} in
  "") ;;
  avx2) export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
  *) echo "$0: REF_ISA must be avx2 or unset, not $REF_ISA" >&2; exit 2 ;;
esac
if ! "$venv/bin/python" -c "import torch, transformers" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.15.0 transformers==5.24.0 safetensors >&2
fi
"$venv/bin/python" - "$model" "$n" "$RUNS" <<'PY'
import os, statistics, sys, time
import torch, transformers
model_dir, n, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(os.cpu_count())
# Its progress bar would land in the middle of bench.sh's table.
transformers.utils.logging.disable_progress_bar()
m = transformers.MiniMaxM3SparseForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
# Ids 3..402: clear of the special and image placeholder ids, as bench.sh's prompts.
ids = torch.tensor([[i % 400 + 3 for i in range(n)]])
steps = 32
with torch.inference_mode():
    m(input_ids=ids[:, :16])
    pre, dec = [], []
    for _ in range(runs):
        t = time.perf_counter()
        m(input_ids=ids, logits_to_keep=1)
        pre.append(time.perf_counter() - t)
        t = time.perf_counter()
        m.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False)
        dec.append(time.perf_counter() - t - pre[-1])
print(f"prefill {n / statistics.median(pre):.1f} decode {steps / statistics.median(dec):.1f}")
PY
