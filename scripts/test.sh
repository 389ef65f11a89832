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
# A fresh checkout gains nothing from incremental compilation, only its
# bookkeeping.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
# Most integration tests wait on mpirun, sockets and timeouts rather than
# compute: several at once on two cores finish sooner (measured: 642 s with
# two, 500 s with four; with 208 tests, 465 s with four and 382 s with
# five, 380-460 s) and every test still passes.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-5}"
# The stages' OpenMP threads (libomp) spin 200 ms at each barrier before
# they sleep: right for a stage that has its cores, ruinous when five tests
# share two. Beside three busy loops, the agents sweep took 416 s with the
# default and 92 s with threads that sleep at once (35 s on a quiet machine).
# No bit depends on it (threads never change a result).
export KMP_BLOCKTIME="${KMP_BLOCKTIME:-0}"
# One kernel thread per stage unless a test names more: five tests share
# two cores, so a second thread only adds a fork and a join to each of the
# tiny models' kernels (the agents corpus: 57 s alone with two, 28 s with
# one; the integration tests: 469 s -> 393 s). The tests that are about
# threads name their counts (1, 2 and 3: pipeline, text, host_kernels).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo build --workspace --locked
cargo test --workspace --locked "$@"
