#!/usr/bin/env bash
# Installs what is missing, then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
# The stage runtime is a static library that `m3c compile` links into each
# stage executable; `cargo test` alone does not build static libraries.
# Gates: formatting (rustfmt.toml) and lints, before anything runs.
rustup component add rustfmt clippy >/dev/null 2>&1 || true
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo build --workspace --locked
cargo test --workspace --locked "$@"
