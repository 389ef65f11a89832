#!/usr/bin/env bash
# The m3c demo: installs what is missing, builds m3c, writes a tiny random
# MiniMax-M3 checkpoint, inspects it and makes a 4-stage pipeline plan for it.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
cargo build --release --locked --bin m3c
M3C=target/release/m3c
work=$(mktemp -d "${TMPDIR:-/tmp}/m3c-demo.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "== m3c init-tiny: a random 8-layer MiniMax-M3 in the hub layout"
$M3C init-tiny "$work/tiny" --seed 1
echo
echo "== m3c inspect"
$M3C inspect "$work/tiny"
echo
echo "== m3c plan --pp 4 (balanced by the cost model)"
$M3C plan --model "$work/tiny" --pp 4 -o "$work/plan.yaml"
echo
echo "== m3c plan --pp 4 for the real MiniMax-M3-MXFP8 on H200 (config only, no weights needed)"
$M3C plan --model configs/minimax-m3-mxfp8.config.json --pp 4 --target cuda -o "$work/m3.yaml"
