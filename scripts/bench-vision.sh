#!/usr/bin/env bash
# Vision benchmarks (CPU):
#   - the real MiniMax-M3-MXFP8 config (vision tower included) compiled for
#     cuda at pp = 4, wall time, and the compile report's vision kernels;
#   - the host time to encode one 672×672 image (2,304 patches, 576 merged
#     tokens) through a tower with the real widths (hidden 1280, 16 heads,
#     MLP 5120, projector 6144, text hidden 6144) and VISION_LAYERS layers
#     (default 2), from an init-tiny checkpoint: the stage's own clock
#     ("vision 1 image(s) in X ms"), median of RUNS runs (default 3), with
#     the FLOPs of that encode and the fraction of this machine's f32 FMA
#     peak, measured on every core by `m3c bench-kernels --peak-only`.
set -euo pipefail
RUNS=${RUNS:-3}
VISION_LAYERS=${VISION_LAYERS:-2}
# shellcheck source=scripts/bench-common.sh
. "$(dirname "$0")/bench-common.sh"

# ptxas and libdevice from scripts/setup.sh's .venv-cuda, unless CUDA_ROOT is set.
if [ -z "${CUDA_ROOT:-}" ]; then
  CUDA_ROOT=$(ls -d .venv-cuda/lib/python3*/site-packages/nvidia/cuda_nvcc 2>/dev/null | head -1)
  export CUDA_ROOT
fi
t0=$(date +%s.%N)
$M3C compile configs/minimax-m3-mxfp8.pp4.yaml --pp 4 -o "$work/mx" > "$work/compile.log" 2>&1 || { cat "$work/compile.log"; exit 1; }
t1=$(date +%s.%N)
echo "compile: MiniMax-M3-MXFP8, cuda sm_90a, pp 4, vision tower included: $(awk "BEGIN {printf \"%.1f\", $t1 - $t0}") s"
echo "compile report rows of the vision kernels (stage 0):"
head -3 "$work/mx/compile-report.txt"
grep -E "m3c_(layer_norm|bias|axial_rope|attention_h16_kv16|linear_i1176|linear_i1280|linear_i5120|linear_i24576)" "$work/mx/compile-report.txt" | grep -E "^ *0 |stage 0|^0" | head -30 || \
  grep -E "m3c_(layer_norm|bias|axial_rope|attention_h16_kv16|linear_i1176|linear_i1280|linear_i5120|linear_i24576)" "$work/mx/compile-report.txt" | head -30

$M3C init-tiny "$work/vt" --layers 1 --hidden 6144 --vision-hidden 1280 --vision-heads 16 --vision-mlp 5120 \
  --vision-layers "$VISION_LAYERS" --projector-hidden 6144 --seed 3 >/dev/null
$M3C compile --model "$work/vt" --pp 1 -o "$work/out" >/dev/null
python3 - "$work/big.png" <<'PY'
import struct, sys, zlib
w = h = 672
raw = b"".join(b"\0" + bytes(v for x in range(w) for v in ((x * 7 + y * 3) % 256, (x * y) % 256, (x ^ y) % 256)) for y in range(h))
chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
open(sys.argv[1], "wb").write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
PY
ms=()
for r in $(seq 1 "$RUNS"); do
  line=$($M3C run "$work/out" --model "$work/vt" --chat "Describe the picture." --image "$work/big.png" --max-new-tokens 1 2>&1 >/dev/null | grep -o 'vision 1 image(s) in [0-9.]* ms')
  ms+=("$(echo "$line" | awk '{print $(NF-1)}')")
done
med=$(printf '%s\n' "${ms[@]}" | median)
peak=$($M3C bench-kernels --peak-only | sed -E 's/FMA peak: ([0-9.]+) GFLOP.*/\1/')
python3 - "$med" "$peak" "$VISION_LAYERS" <<'PY'
import sys
ms, peak, layers = float(sys.argv[1]), float(sys.argv[2]) * 1e9, int(sys.argv[3])
P, M, vh, mlp, ph, th, row = 2304, 576, 1280, 5120, 6144, 6144, 1176
flops = 2 * P * row * vh                                   # patch embedding
flops += layers * (2 * P * (4 * vh * vh + 2 * vh * mlp)    # q, k, v, out; fc1, fc2
                   + 2 * 2 * P * P * vh)                   # QK^T and PV over one 2304-row image
flops += 2 * P * (vh * ph + ph * th)                       # projector
flops += 2 * M * (4 * th * ph + ph * th)                   # 2x2 merge MLP
print(f"encode 672x672 (2304 patches -> 576 tokens), {layers} layer(s) at real widths: {ms:.0f} ms median of runs; "
      f"{flops / 1e9:.1f} GFLOP -> {flops / (ms / 1e3) / 1e9:.1f} GFLOP/s = {100 * flops / (ms / 1e3) / peak:.1f}% of the measured FMA peak ({peak / 1e9:.1f} GFLOP/s)")
PY
