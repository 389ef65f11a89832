#!/usr/bin/env bash
# Installs what m3c needs to build and test on Debian 12, and nothing that is
# already there. Safe to run again; quick when everything is present.
set -euo pipefail

# Debian packages the build and the tests use. LLVM/MLIR 22 comes from
# bookworm-security (bookworm's 19 conflicts with it); melior, mlir-sys and
# inkwell link it statically into m3c.
# Open MPI links and launches the stage executables (with LLVM's lld, over
# three times as fast as gold here); LLVM's OpenMP runtime runs the
# generated kernels' parallel loops. FFmpeg's libraries decode videos (the
# front's `vision/video.rs` says why not a pure-Rust decoder); ffmpeg-next's
# bindings are generated against them with LLVM 22's libclang.
PACKAGES=(build-essential pkg-config llvm-22-dev libmlir-22-dev libpolly-22-dev libclang1-22
          libclang-common-22-dev libzstd-dev zlib1g-dev libxml2-dev libz3-dev
          openmpi-bin libopenmpi-dev libomp-22-dev lld-22 curl ca-certificates python3-venv
          libavcodec-dev libavformat-dev libavutil-dev libswscale-dev)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Rust: rustup's minimal profile when there is no cargo at all.
if ! command -v cargo >/dev/null 2>&1 && [ ! -x "$HOME/.cargo/bin/cargo" ]; then
  echo "setup: installing Rust 1.87 or newer (rustup, minimal profile)"
  curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal >/dev/null
fi

# The Python environments the tests use, each in its own folder at the
# repository root, installed side by side (each is mostly waiting on pip;
# one after another they took 32 s of a fresh clone's test run). pip's
# check for a newer pip of its own is skipped: it is a network round trip
# per install.
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The CUDA back end needs libdevice (math functions) and ptxas (assembling
# PTX, the compile report); NVIDIA's nvidia-cuda-nvcc wheel has both and
# needs no GPU. It goes into .venv-cuda.
venv_cuda() {
  if ! ls "$ROOT"/.venv-cuda/lib/python3*/site-packages/nvidia/cuda_nvcc/bin/ptxas >/dev/null 2>&1; then
    echo "setup: installing ptxas and libdevice (nvidia-cuda-nvcc-cu12) into .venv-cuda"
    python3 -m venv "$ROOT/.venv-cuda"
    "$ROOT/.venv-cuda/bin/pip" install -q nvidia-cuda-nvcc-cu12==12.9.86
  fi
}

# m3c serve's tests talk to it with OpenAI's own Python client, and
# Anthropic's for the Messages API (/v1/messages), in .venv-serve.
venv_serve() {
  if ! "$ROOT/.venv-serve/bin/python" -c "import openai" >/dev/null 2>&1; then
    echo "setup: installing the openai Python client into .venv-serve (for m3c serve's tests)"
    python3 -m venv "$ROOT/.venv-serve"
    "$ROOT/.venv-serve/bin/pip" install -q openai==2.8.0
  fi
  if ! "$ROOT/.venv-serve/bin/python" -c "import anthropic" >/dev/null 2>&1; then
    echo "setup: installing the anthropic Python client into .venv-serve (for m3c serve's tests)"
    "$ROOT/.venv-serve/bin/pip" install -q anthropic==2.17.0
  fi
}

# The routers users put in front of replicas (vllm-router, SGLang's
# gateway `smg`), for the tests that serve behind them (tests/it/routers.rs).
# pyzmq and msgpack read m3c's KV-cache events as a router's subscriber would.
venv_router() {
  if ! [ -x "$ROOT/.venv-router/bin/vllm-router" ] || ! [ -x "$ROOT/.venv-router/bin/smg" ] \
    || ! "$ROOT/.venv-router/bin/python" -c "import zmq, msgpack" >/dev/null 2>&1; then
    echo "setup: installing vllm-router, smg, pyzmq and msgpack into .venv-router (for m3c serve's router tests)"
    python3 -m venv "$ROOT/.venv-router"
    "$ROOT/.venv-router/bin/pip" install -q vllm-router==0.1.17 smg==1.13.0 pyzmq==27.3.0 msgpack==1.2.4
  fi
}

pids=()
for job in venv_cuda venv_serve venv_router; do
  "$job" &
  pids+=("$!")
done
failed=0
for p in "${pids[@]}"; do
  wait "$p" || failed=1
done
if [ "$failed" -ne 0 ]; then
  echo "setup: a Python environment could not be installed (pip's message is above)" >&2
  exit 1
fi
