#!/usr/bin/env bash
# The prepared GPU check of a GPU back end, in two phases:
#
#   scripts/gpu-check.sh prepare [cuda|rocm]   # on a CPU build machine (network, Rust, LLVM 22)
#   scripts/gpu-check.sh run [cuda|rocm]       # on the GPU machine (driver, no network), < 8 min
#
# cuda (the default) checks an NVIDIA H200 (sm_90a); rocm checks an AMD
# MI300X (gfx942, ROCm 6 or later there: HIP, and RCCL if installed).
# `prepare` builds m3c, compiles every executable the check runs for the
# target, and packs them with the Open MPI and libomp libraries they need
# into gpu-bundle.tar.xz (rocm: gpu-bundle-rocm.tar.xz) at the repository
# root; `run` (in the repository copy on the GPU machine, the bundle beside
# it) unpacks it and runs:
#   1. the tiny fixtures (bf16 and MXFP8) at pp = 1 and pp = 2 (both stages
#      on GPU 0, host-staged transfers) against their goldens: f32 activations,
#      so the tokens must be exact and logits within 1e-3; then two prompts in
#      one micro-batch with decode replayed from CUDA graphs and without,
#      whose dumps must be byte-identical; the device sampler (temperature,
#      top-k, top-p, min-p, repetition penalty) against the host sampler
#      replayed on the GPU's own dumped logits: every id must be equal;
#      the tiny fixture's image + text prefill (the vision entry on the GPU,
#      its features over the placeholder rows) against the reference's
#      mm_logits at pp = 1 and 2 (within 1e-3, pp dumps byte-identical);
#      tiny-m3 with bf16 and with fp8 caches; tiny-m3 with its EAGLE3 draft head (ids
#      and logprobs equal to the same stages' without it); and
#      both fixtures with bf16 activations (the GPU default), their distance
#      from the f32 golden reported (on the host: median position 0.07-0.09,
#      a few positions where an expert or MSA block choice flips up to 2.3);
#   2. (bf16 activations, the GPU default, from here on) one decode step of a real-size M3 layer (dense: full attention + dense
#      MLP; MoE: MSA + 128 experts top-4 + shared), bf16 and MXFP8, with
#      synthetic weights of the real shapes, at batch 1 and 16 (16 sequences
#      in one micro-batch), next to the HBM floor (bytes the layer reads per
#      step at that batch, from m3c's cost model, / 4.8 TB/s). The layer runs alone in
#      the middle stage of a 3-stage pipeline (embedding | layer | head), and
#      that stage reports its own compute time per step (bf16 at batch 1 also
#      with --graphs off, to show what graph replay saves);
#   3. prefill linears on cuBLAS tensor cores (--prefill-gemm vendor: cuBLAS; MXFP8
#      weights decoded to bf16 per call) against m3c's GEMV kernel: both tiny
#      fixtures' distance from their goldens, and a 1024-token prefill of the
#      real-size dense layer, bf16 and MXFP8, timed both ways (cuda only:
#      rocm has no GEMM library yet).
# On rocm "CUDA graphs" are HIP graphs (the same --graphs flag) and the
# HBM floor is the MI300X's 5.3 TB/s. It prints one table last.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TARGET="${2:-cuda}"
case "$TARGET" in
  cuda) ARCH=sm_90a; HBM_TBS=4.8; BUNDLE="$ROOT/gpu-bundle.tar.xz" ;;
  rocm) ARCH=gfx942; HBM_TBS=5.3; BUNDLE="$ROOT/gpu-bundle-rocm.tar.xz" ;;
  *) echo "gpu-check: unknown target \`$TARGET\`: expected cuda or rocm" >&2; exit 2 ;;
esac

# Open MPI's runtime packages (Debian 12), minus what every Linux has.
OMPI_DEBS=(openmpi-bin libopenmpi3 openmpi-common libpmix2 libhwloc15 libevent-core-2.1-7 libevent-pthreads-2.1-7
           libfabric1 libucx0 libibverbs1 librdmacm1 libpsm2-2 libpsm-infinipath1 libnl-3-200 libnl-route-3-200
           libmunge2 libnuma1 libpciaccess0 libxnvctrl0 ocl-icd-libopencl1)

plan3() { # a 3-stage plan: embedding | layer 0 | norm + lm_head, all on GPU 0
  cat <<EOF
version: 1
target: $TARGET
arch: $ARCH
stages:
  - embedding: true
    device: 0
  - layers: "0"
    device: 0
  - final_norm: true
    lm_head: true
    device: 0
EOF
}

plan2() { # the tiny fixtures at pp = 2, both stages on GPU 0
  cat <<EOF
version: 1
target: $TARGET
arch: $ARCH
stages:
  - layers: "0-3"
    embedding: true
    device: 0
  - layers: "4-7"
    final_norm: true
    lm_head: true
    device: 0
EOF
}

prepare() {
  ./scripts/setup.sh
  export PATH="$HOME/.cargo/bin:$PATH"
  cargo build --release --locked -q -p m3c -p m3c-runtime
  cargo build --release --locked -q -p m3c-sampler --example sampled_check
  M3C="$ROOT/target/release/m3c"
  CUDA_ROOT=$(ls -d "$ROOT"/.venv-cuda/lib/python3*/site-packages/nvidia/cuda_nvcc | head -1)
  export CUDA_ROOT
  work=$(mktemp -d "${TMPDIR:-/tmp}/m3c-gpu.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  b="$work/bundle"
  mkdir -p "$b/out" "$b/lib" "$b/ompi" "$b/plans" "$b/bin"
  cp "$ROOT/target/release/examples/sampled_check" "$b/bin/"

  echo "== fixtures: $TARGET stages at pp = 1 and pp = 2"
  for m in tiny-m3 tiny-m3-mxfp8; do
    # f32 activations: the exact mode the goldens are checked in.
    $M3C compile --model "tests/fixtures/$m" --pp 1 --target "$TARGET" --activations f32 -o "$b/out/$m-pp1" >/dev/null
    plan2 > "$b/plans/tiny-pp2.yaml"
    $M3C compile --model "tests/fixtures/$m" --pp 2 "$b/plans/tiny-pp2.yaml" --activations f32 -o "$b/out/$m-pp2" >/dev/null
    $M3C compile --model "tests/fixtures/$m" --pp 1 --target "$TARGET" --activations bf16 -o "$b/out/$m-pp1-abf16" >/dev/null
  done
  $M3C compile --model tests/fixtures/tiny-m3 --pp 1 --target "$TARGET" --activations f32 --kv-cache bf16 -o "$b/out/tiny-m3-pp1-kvbf16" >/dev/null
  $M3C compile --model tests/fixtures/tiny-m3 --pp 1 --target "$TARGET" --activations f32 --kv-cache fp8 -o "$b/out/tiny-m3-pp1-kvfp8" >/dev/null
  # EAGLE3: tiny-m3's draft head compiled into the last stage (the path is
  # the repository's, the same on the GPU machine).
  $M3C compile --model tests/fixtures/tiny-m3 --pp 2 "$b/plans/tiny-pp2.yaml" --activations f32 -o "$b/out/tiny-m3-pp2-eagle3" \
    --speculative-config '{"method": "eagle3", "model": "tests/fixtures/eagle3-tiny", "num_speculative_tokens": 3}' >/dev/null
  # The golden image input as the images file a first stage reads.
  python3 - tests/fixtures/tiny-m3/golden.safetensors "$b/mm-images.safetensors" <<'PY'
import json, struct, sys
b = open(sys.argv[1], 'rb').read(); n = struct.unpack('<Q', b[:8])[0]; h = json.loads(b[8:8+n]); d = b[8+n:]
raw = lambda k: d[h[k]['data_offsets'][0]:h[k]['data_offsets'][1]]
grid, pix = raw('mm_image_grid_thw'), raw('mm_pixel_values')
hdr = {"seq0.image_grid_thw": {"dtype": "I64", "shape": h['mm_image_grid_thw']['shape'], "data_offsets": [0, len(grid)]},
       "seq0.pixel_values": {"dtype": "F32", "shape": h['mm_pixel_values']['shape'], "data_offsets": [len(grid), len(grid) + len(pix)]}}
j = json.dumps(hdr).encode(); j += b' ' * ((8 - len(j) % 8) % 8)
open(sys.argv[2], 'wb').write(struct.pack('<Q', len(j)) + j + grid + pix)
PY

  echo "== real-size single layers (config only; weights are synthesised on the GPU machine)"
  : > "$b/floors.txt"
  for q in bf16 mxfp8; do
    base=configs/minimax-m3.config.json
    [ $q = mxfp8 ] && base=configs/minimax-m3-mxfp8.config.json
    for kind in dense moe; do
      d="$b/models/$kind-$q"
      mkdir -p "$d"
      python3 - "$base" "$kind" "$d/config.json" <<'PY'
import json, sys
base, kind, out = sys.argv[1:]
c = json.load(open(base))
t = c["text_config"]
moe = 1 if kind == "moe" else 0
t["num_hidden_layers"] = 1
t["moe_layer_freq"] = [moe]
s = t["sparse_attention_config"]
s["sparse_attention_freq"] = [moe]
s["sparse_disable_index_value"] = [moe]
q = c.get("quantization_config")
if q:
    q["ignored_layers"] = [x for x in q["ignored_layers"] if "block_sparse_moe.gate" not in x] + \
        (["language_model.model.layers.0.block_sparse_moe.gate"] if moe else [])
json.dump(c, open(out, "w"), indent=1)
PY
      plan3 > "$b/plans/layer.yaml"
      $M3C compile --model "$d" --pp 3 "$b/plans/layer.yaml" -o "$b/out/$kind-$q" >/dev/null
      # Bytes the layer stage reads per decode step (the cost model's figure).
      for batch in 1 16; do
        gb=$($M3C plan --check "$b/plans/layer.yaml" --model "$d" --batch $batch --context 4096 | awk '$1 == "1" {print $(NF-1)}')
        echo "$kind-$q-$batch $gb" >> "$b/floors.txt"
      done
    done
  done
  strip "$b"/out/*/stage-*

  echo "== Open MPI and libomp for the GPU machine"
  (cd "$work" && apt-get download "${OMPI_DEBS[@]}" >/dev/null)
  for deb in "$work"/*.deb; do dpkg -x "$deb" "$b/ompi"; done
  cp -L /usr/lib/llvm-22/lib/libomp.so.5 "$b/lib/"
  tar -C "$work" -cJf "$BUNDLE" bundle
  echo "wrote $BUNDLE ($(du -h "$BUNDLE" | cut -f1)); run it there with: scripts/gpu-check.sh run"
}

# A golden file's prompt_ids as `1,2,3`.
prompt_ids() {
  python3 - "$1" <<'PY'
import json, struct, sys
b = open(sys.argv[1], 'rb').read(); n = struct.unpack('<Q', b[:8])[0]; h = json.loads(b[8:8+n])
s, e = h['prompt_ids']['data_offsets']; d = b[8+n+s:8+n+e]
print(','.join(str(x) for x in struct.unpack('<%dq' % (len(d)//8), d)))
PY
}

# The first error a stage reported in LOG, else its last line.
why() { grep -m1 'error' "$1" || tail -1 "$1"; }

run() {
  [ -f "$BUNDLE" ] || { echo "gpu-check: $BUNDLE is missing; make it with scripts/gpu-check.sh prepare" >&2; exit 1; }
  work=$(mktemp -d "${TMPDIR:-/tmp}/m3c-gpu.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  tar -C "$work" -xJf "$BUNDLE"
  b="$work/bundle"
  # Logs stay (under $OUT when the device tool runs this, so they come back).
  logs="${OUT:-$ROOT/gpu-check-logs}"
  mkdir -p "$logs"
  export OPAL_PREFIX="$b/ompi/usr"
  export PATH="$b/ompi/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$b/lib:$b/ompi/usr/lib/x86_64-linux-gnu:$b/ompi/usr/lib/x86_64-linux-gnu/openmpi/lib:${LD_LIBRARY_PATH:-}"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  export OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1
  if [ "$TARGET" = rocm ]; then
    gpu=$( (rocm-smi --showproductname --csv 2>/dev/null | sed -n 2p) || echo "no rocm-smi")
    libs="amdhip64:HIP rccl:RCCL"
  else
    gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1 || echo "no nvidia-smi")
    libs="cublas:CUBLAS nccl:NCCL"
  fi
  echo "GPU: $gpu"
  # The vendor's libraries as that machine has them (e.g. in its Python's
  # nvidia-* wheels, or under /opt/rocm).
  for pair in $libs; do
    lib=${pair%%:*}
    f=$(find /opt /usr/local /usr/lib -name "lib$lib.so.[0-9]*" 2>/dev/null | grep -v stub | sort | tail -1 || true)
    # (An `if`, not `&&`: a library that is missing must not end the check under `set -e`.)
    if [ -n "$f" ]; then export "M3C_${pair##*:}_LIB=$f"; echo "lib$lib: $f"; else echo "lib$lib: not found"; fi
  done
  rows=()

  for m in tiny-m3 tiny-m3-mxfp8; do
    golden="tests/fixtures/$m/golden.safetensors"
    prompt=$(prompt_ids "$golden")
    for pp in 1 2; do
      log="$logs/$m-pp$pp.log"
      if timeout 120 "$b/out/$m-pp$pp/run.sh" --model "tests/fixtures/$m" --prompt-ids "$prompt" --max-new-tokens 16 \
           --expect "$golden" >"$log" 2>&1; then verdict=pass; else verdict=FAIL; fi
      check=$(grep -o 'prefill max.*' "$log" | head -1 || true)
      rows+=("$(printf '%-32s %-6s %-5s %s' "$m (f32 act.)" "pp=$pp" "$verdict" "${check:-$(why "$log")}")")
    done
    # CUDA graphs change nothing: two prompts in one micro-batch, decode
    # replayed from graphs vs every kernel launched, dump bytes compared.
    for g in on off; do
      timeout 120 "$b/out/$m-pp2/run.sh" --model "tests/fixtures/$m" --prompt-ids "$prompt" --prompt-ids "3,1,4,1,5" \
        --micro-batch 2 --max-new-tokens 12 --graphs $g --dump "$work/$m-graphs-$g.safetensors" >"$logs/$m-graphs-$g.log" 2>&1 || true
    done
    replays=$(grep -o '[0-9]* decode step(s) replayed' "$logs/$m-graphs-on.log" | head -1 || true)
    if cmp -s "$work/$m-graphs-on.p0.safetensors" "$work/$m-graphs-off.p0.safetensors" \
       && cmp -s "$work/$m-graphs-on.p1.safetensors" "$work/$m-graphs-off.p1.safetensors"; then verdict=pass; else verdict=FAIL; fi
    rows+=("$(printf '%-32s %-6s %-5s %s' "$m $([ "$TARGET" = rocm ] && echo HIP || echo CUDA) graphs" "pp=2" "$verdict" "graphs on = off, dump bytes of 2 prompts; ${replays:-$(why "$logs/$m-graphs-on.log")}")")
    # Paged caches on the device: four prompts sharing a 36-token prefix,
    # from a pool of 14 blocks (so they are preempted and resume) with
    # prefix caching, against each computed in full from the default pool:
    # the same ids and logprobs.
    pre=$(echo "$prompt" | cut -d, -f1-36)
    paged=(--model "tests/fixtures/$m" --prompt-ids "$pre,7" --prompt-ids "$pre,8,9" --prompt-ids "$pre,10,11,12" --prompt-ids "$pre,13"
           --max-new-tokens 8 --logprobs 2 --micro-batch 2)
    timeout 120 "$b/out/$m-pp2/run.sh" "${paged[@]}" --prefix-caching off >"$logs/$m-paged-cold.log" 2>&1 || true
    timeout 120 "$b/out/$m-pp2/run.sh" "${paged[@]}" --kv-blocks 14 >"$logs/$m-paged.log" 2>&1 || true
    cold=$(grep -E '^(prompt|logprobs) ' "$logs/$m-paged-cold.log" || true)
    warm=$(grep -E '^(prompt|logprobs) ' "$logs/$m-paged.log" || true)
    if [ -n "$cold" ] && [ "$cold" = "$warm" ]; then verdict=pass; else verdict=FAIL; fi
    kvline=$(grep -o 'm3c kv:.*' "$logs/$m-paged.log" | head -1 || true)
    rows+=("$(printf '%-32s %-6s %-5s %s' "$m paged KV, prefix cache" "pp=2" "$verdict" "14-block pool = cold run, ids and logprobs of 4 prompts; ${kvline:-$(why "$logs/$m-paged.log")}")")
    if [ "$m" = tiny-m3 ]; then
      # The device sampler picks what the host sampler picks on the same
      # logits: the GPU's own, dumped.
      log="$logs/$m-sampled.log"
      sp=(0.8 40 0.95 0.02 1.1 7)
      timeout 120 "$b/out/$m-pp1/run.sh" --model "tests/fixtures/$m" --prompt-ids "$prompt" --max-new-tokens 32 \
        --temperature ${sp[0]} --top-k ${sp[1]} --top-p ${sp[2]} --min-p ${sp[3]} --repetition-penalty ${sp[4]} --seed ${sp[5]} \
        --dump "$work/$m-sampled.safetensors" >"$log" 2>&1 || true
      if "$b/bin/sampled_check" "$work/$m-sampled.safetensors" "${sp[@]}" >>"$log" 2>&1; then verdict=pass; else verdict=FAIL; fi
      rows+=("$(printf '%-32s %-6s %-5s %s' "$m device sampler" "pp=1" "$verdict" "$(grep -o 'device sampler:.*\|error.*' "$log" | head -1)")")
      # An image prompt: the vision entry on the GPU, against mm_logits.
      mm=$(python3 - "$golden" <<'PY'
import json, struct, sys
b = open(sys.argv[1], 'rb').read(); n = struct.unpack('<Q', b[:8])[0]; h = json.loads(b[8:8+n])
s, e = h['mm_input_ids']['data_offsets']; d = b[8+n+s:8+n+e]
print(','.join(str(x) for x in struct.unpack('<%dq' % (len(d)//8), d)))
PY
)
      for pp in 1 2; do
        timeout 120 "$b/out/$m-pp$pp/run.sh" --model "tests/fixtures/$m" --prompt-ids "$mm" --images "$b/mm-images.safetensors" \
          --max-new-tokens 4 --dump "$work/mm-pp$pp.safetensors" >"$logs/$m-image-pp$pp.log" 2>&1 || true
      done
      check="no dump from pp=1"
      [ -f "$work/mm-pp1.safetensors" ] && check=$(python3 - "$golden" "$work/mm-pp1.safetensors" <<'PY' 2>&1 || true
import json, struct, sys
def f32(path, name):
    b = open(path, 'rb').read(); n = struct.unpack('<Q', b[:8])[0]; h = json.loads(b[8:8+n])
    s, e = h[name]['data_offsets']; d = b[8+n+s:8+n+e]
    return struct.unpack('<%df' % (len(d)//4), d)
a, g = f32(sys.argv[2], 'prefill_logits'), f32(sys.argv[1], 'mm_logits')
m = max(abs(x - y) for x, y in zip(a, g))
print(f"mm_logits max |d| {m:.2e}" + (" (over 1e-3)" if m > 1e-3 else ""))
PY
)
      if [[ "$check" == "mm_logits max |d| "* && "$check" != *over* ]] && cmp -s "$work/mm-pp1.safetensors" "$work/mm-pp2.safetensors"; then verdict=pass; else verdict=FAIL; fi
      rows+=("$(printf '%-32s %-6s %-5s %s' "$m image prompt" "pp=1,2" "$verdict" "$check; pp=2 dump = pp=1: $(cmp -s "$work/mm-pp1.safetensors" "$work/mm-pp2.safetensors" && echo yes || echo no); $(grep -o 'vision 1 image(s) in [0-9.]* ms' "$logs/$m-image-pp1.log" | head -1 || why "$logs/$m-image-pp1.log")")")
      # bf16 caches: logits move by rounding (on the host: max |Δ| ~1e-2, one
      # position 1.4 where an MSA block choice flips), so this row reports, not judges.
      log="$logs/$m-kvbf16.log"
      timeout 120 "$b/out/$m-pp1-kvbf16/run.sh" --model "tests/fixtures/$m" --prompt-ids "$prompt" --max-new-tokens 16 \
        --expect "$golden" >"$log" 2>&1 || true
      check=$(grep -o 'prefill max.*' "$log" | head -1 || true)
      rows+=("$(printf '%-32s %-6s %-5s %s' "$m bf16 caches" "pp=1" "$([ -n "$check" ] && echo ran || echo FAIL)" "${check:-$(why "$log")}")")
      # fp8 caches (e4m3, scale 1): reported like bf16's (on the host: median
      # position 0.16 from the golden, 2.3 at worst).
      log="$logs/$m-kvfp8.log"
      timeout 120 "$b/out/$m-pp1-kvfp8/run.sh" --model "tests/fixtures/$m" --prompt-ids "$prompt" --max-new-tokens 16 \
        --expect "$golden" >"$log" 2>&1 || true
      check=$(grep -o 'prefill max.*' "$log" | head -1 || true)
      rows+=("$(printf '%-32s %-6s %-5s %s' "$m fp8 caches" "pp=1" "$([ -n "$check" ] && echo ran || echo FAIL)" "${check:-$(why "$log")}")")
      # EAGLE3 on the device: aux states carried in device memory, the
      # head's entries on the last stage; ids and logprobs as without it.
      e3=(--model "tests/fixtures/$m" --prompt-ids "$prompt" --prompt-ids "7,7,7,7" --micro-batch 2 --max-new-tokens 24 --logprobs 2)
      timeout 120 "$b/out/$m-pp2-eagle3/run.sh" "${e3[@]}" >"$logs/$m-eagle3-plain.log" 2>&1 || true
      timeout 120 "$b/out/$m-pp2-eagle3/run.sh" "${e3[@]}" --eagle3 3 --draft-model tests/fixtures/eagle3-tiny >"$logs/$m-eagle3.log" 2>&1 || true
      plain=$(grep -E '^(prompt|logprobs) ' "$logs/$m-eagle3-plain.log" || true)
      spec=$(grep -E '^(prompt|logprobs) ' "$logs/$m-eagle3.log" || true)
      specline=$(grep -o 'm3c spec:.*' "$logs/$m-eagle3.log" | head -1 || true)
      if [ -n "$plain" ] && [ "$plain" = "$spec" ] && [ -n "$specline" ]; then verdict=pass; else verdict=FAIL; fi
      rows+=("$(printf '%-32s %-6s %-5s %s' "$m EAGLE3" "pp=2" "$verdict" "ids and logprobs = plain; ${specline:-$(why "$logs/$m-eagle3.log")}")")
    fi
    # bf16 activations (the GPU default): reported, not judged, like the caches.
    log="$logs/$m-abf16.log"
    timeout 120 "$b/out/$m-pp1-abf16/run.sh" --model "tests/fixtures/$m" --prompt-ids "$prompt" --max-new-tokens 16 \
      --expect "$golden" >"$log" 2>&1 || true
    check=$(grep -o 'prefill max.*' "$log" | head -1 || true)
    rows+=("$(printf '%-32s %-6s %-5s %s' "$m bf16 act." "pp=1" "$([ -n "$check" ] && echo ran || echo FAIL)" "${check:-$(why "$log")}")")
  done

  # Tensor-core GEMMs (cuBLAS) for prefill vs m3c's GEMV kernel: each tiny
  # fixture with every linear on cuBLAS (inputs rounded to bf16: reported),
  # and one 1024-token prefill of the real-size dense layer both ways.
  # rocm has no GEMM library yet: the GEMV prefill alone.
  gemms="off vendor"
  [ "$TARGET" = rocm ] && gemms="off"
  for m in $([ "$TARGET" = cuda ] && echo tiny-m3 tiny-m3-mxfp8); do
    golden="tests/fixtures/$m/golden.safetensors"
    prompt=$(prompt_ids "$golden")
    log="$logs/$m-cublas.log"
    M3C_GEMM_MIN_ROWS=1 timeout 120 "$b/out/$m-pp1/run.sh" --model "tests/fixtures/$m" --prompt-ids "$prompt" --max-new-tokens 16 \
      --prefill-gemm vendor --expect "$golden" >"$log" 2>&1 || true
    check=$(grep -o 'prefill max.*' "$log" | head -1 || true)
    rows+=("$(printf '%-32s %-6s %-5s %s' "$m prefill on cuBLAS" "pp=1" "$([ -n "$check" ] && echo ran || echo FAIL)" "${check:-$(why "$log")}; $(grep -o 'run on cuBLAS\|cuBLAS not found[^;]*' "$log" | head -1)")")
  done
  long=$(seq -s, 1 1024)
  for q in bf16 mxfp8; do
    times=""
    for g in $gemms; do
      log="$logs/dense-$q-prefill-$g.log"
      if timeout 150 "$b/out/dense-$q/run.sh" --synthetic-weights 1 --prompt-ids "$long" --max-new-tokens 2 --prefill-gemm $g >"$log" 2>&1; then
        times="$times $g $(grep 'm3c stage 1/3: done' "$log" | sed -E 's/.*prefill [0-9]+ step\(s\), mean ([0-9.]+) ms.*/\1/') ms;"
      else
        times="$times $g FAIL ($(why "$log"));"
      fi
    done
    rows+=("$(printf '%-32s %-8s %-5s %s' "dense layer, $q" "prefill" "$(case "$times" in *FAIL*) echo FAIL ;; *) echo ran ;; esac)" "1024 tokens, layer stage:$times")")
  done

  for q in bf16 mxfp8; do
    for kind in dense moe; do
      for batch in 1 16; do
        log="$logs/$kind-$q-b$batch.log"
        gb=$(awk -v k="$kind-$q-$batch" '$1 == k {print $2}' "$b/floors.txt")
        prompts=()
        for i in $(seq 1 $batch); do prompts+=(--prompt-ids "$(seq -s, $i $((i + 15)))"); done
        if timeout 150 "$b/out/$kind-$q/run.sh" --synthetic-weights 1 "${prompts[@]}" --micro-batch $batch --max-new-tokens 16 >"$log" 2>&1; then
          ms=$(grep 'm3c stage 1/3: done' "$log" | sed -E 's/.*decode [0-9]+ step\(s\), mean ([0-9.]+) ms.*/\1/')
          floor=$(awk -v g="$gb" -v t="$HBM_TBS" 'BEGIN {printf "%.3f", g / t}')
          frac=$(awk -v f="$floor" -v m="$ms" 'BEGIN {printf "%.0f%%", 100 * f / m}')
          nograph=""
          if [ "$batch" = 1 ] && [ "$q" = bf16 ] && timeout 150 "$b/out/$kind-$q/run.sh" --synthetic-weights 1 "${prompts[@]}" --micro-batch $batch \
               --max-new-tokens 16 --graphs off >"$log.nographs" 2>&1; then
            nograph="; without graphs $(grep 'm3c stage 1/3: done' "$log.nographs" | sed -E 's/.*decode [0-9]+ step\(s\), mean ([0-9.]+) ms.*/\1/') ms"
          fi
          rows+=("$(printf '%-32s %-8s %-5s decode step %s ms; HBM floor %s ms (%s GB); %s of the floor%s' "$kind layer, $q" "batch $batch" "ran" "$ms" "$floor" "$gb" "$frac" "$nograph")")
        else
          rows+=("$(printf '%-32s %-8s %-5s %s' "$kind layer, $q" "batch $batch" "FAIL" "$(why "$log")")")
        fi
      done
    done
  done
  echo
  echo "m3c GPU check on $gpu"
  printf '%s\n' "${rows[@]}"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  *) echo "usage: scripts/gpu-check.sh prepare [cuda|rocm] | run [cuda|rocm]" >&2; exit 2 ;;
esac
