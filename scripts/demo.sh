#!/usr/bin/env bash
# The m3c demo: installs what is missing, builds m3c, writes a tiny random
# MiniMax-M3 checkpoint, compiles it into a 4-stage pipeline, runs the four
# stage executables under mpirun, and checks the tokens against a 1-stage run;
# then a chat turn, and a chat turn about a picture.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
# M3C=PATH runs an m3c already built (the README's test gives its own).
if [ -z "${M3C:-}" ]; then
  cargo build --release --locked -p m3c -p m3c-runtime
  M3C=target/release/m3c
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/m3c-demo.XXXXXX")
trap 'rm -rf "$work"' EXIT
PROMPT="The capital of France is"

echo "== m3c init-tiny: a random 8-layer MiniMax-M3 (MSA, MoE, hub layout)"
$M3C init-tiny "$work/tiny" --seed 1
echo
echo "== m3c compile --pp 4: the planner splits it; one executable per stage"
$M3C compile --model "$work/tiny" --pp 4 -o "$work/pp4"
echo
echo "== m3c run: 4 MPI ranks, one per stage, greedy decoding of 16 tokens of text"
echo "   (the weights are random: the text is noise; the path is the real one)"
$M3C run "$work/pp4" --model "$work/tiny" --prompt "$PROMPT" --max-new-tokens 16 --dump "$work/pp4.safetensors" | tee "$work/pp4.txt"
echo
echo "== the pipeline's timeline: four prompts in flight through the four stages (--trace, m3c report)"
$M3C run "$work/pp4" --model "$work/tiny" --prompt "$PROMPT" --prompt "The tallest mountain is" --prompt "Water boils at" \
  --prompt "The largest ocean is" --max-new-tokens 16 --trace "$work/pp4.trace.json" >/dev/null 2>&1
$M3C report "$work/pp4.trace.json"
echo "   (the trace opens in Perfetto or chrome://tracing; this demo removes its folder at the end)"
echo
echo "== the same model compiled as one stage"
$M3C compile --model "$work/tiny" --pp 1 -o "$work/pp1" >/dev/null
$M3C run "$work/pp1" --model "$work/tiny" --prompt "$PROMPT" --max-new-tokens 16 --dump "$work/pp1.safetensors" 2>/dev/null | tee "$work/pp1.txt"
echo
echo "== a chat turn through the checkpoint's chat template"
$M3C run "$work/pp4" --model "$work/tiny" --chat "What is the capital of France?" --thinking disabled --max-new-tokens 16 2>/dev/null
echo
echo "== showing it a picture: the image processor, the vision tower on stage 0, then the chat"
python3 - "$work/picture.png" <<'PY'
import struct, sys, zlib
w, h = 168, 112  # resized to 168x112: 6 x 4 blocks of 28 pixels = 24 image tokens
rows = b"".join(b"\0" + bytes(v for x in range(w) for v in (2 * x % 256, 2 * y % 256, 160)) for y in range(h))
chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
open(sys.argv[1], "wb").write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
PY
$M3C run "$work/pp4" --model "$work/tiny" --chat "What is in this picture?" --image "$work/picture.png" --thinking disabled \
  --max-new-tokens 16 2>"$work/picture.log"
echo
grep -o 'vision 1 image(s) in [0-9.]* ms' "$work/picture.log" | sed 's/^/   stage 0: /'
grep 'prompt 0:' "$work/picture.log" | sed 's/^/   /'
echo
if cmp -s "$work/pp1.txt" "$work/pp4.txt" && cmp -s "$work/pp1.safetensors" "$work/pp4.safetensors"; then
  echo "pp = 4 text equals pp = 1: yes (and every logit is bit-identical)"
else
  echo "pp = 4 text equals pp = 1: NO" >&2
  exit 1
fi
