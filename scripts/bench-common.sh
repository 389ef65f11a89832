# Sourced by scripts/bench.sh, bench-vision.sh and bench-routers.sh: from the
# repository root, a release build of m3c and the stage runtime, a work
# folder removed on exit, and `median` (of numbers on standard input).
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
cargo build --release --locked -q -p m3c -p m3c-runtime
M3C=target/release/m3c
work=$(mktemp -d "${TMPDIR:-/tmp}/m3c-$(basename "$0" .sh).XXXXXX")
trap 'rm -rf "$work"' EXIT
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
