#!/usr/bin/env bash
# Installs what is missing, then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
# The stage runtime is a static library that `m3c compile` links into each
# stage executable; `cargo test` alone does not build static libraries.
cargo build --workspace --locked
cargo test --workspace --locked "$@"
