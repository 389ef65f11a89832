#!/usr/bin/env bash
# Open MPI's session-folder race, reproduced: many short mpirun jobs side by
# side on a loaded machine, all in the default session folder (`default`),
# or each in a base of its own as m3c launches them (`own`). With `default`
# a job that starts while another ends fails now and then in orte_init
# ("A call to mkdir was unable to create the desired directory ... File
# exists"); with `own` none should.
#
#   scripts/mpi-session-race.sh default|own [JOBS_PER_WORKER]
set -euo pipefail
mode=${1:?usage: $0 default|own [JOBS_PER_WORKER]}
per=${2:-200}
case $mode in default | own) ;; *) echo "$0: mode must be default or own, not $mode" >&2; exit 2 ;; esac
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
# Load every core, so that a process is preempted between two system calls.
for _ in $(seq "$(nproc)") $(seq "$(nproc)"); do (while :; do :; done) & done
busy=$(jobs -p)
for w in 1 2 3 4 5 6; do
    (for i in $(seq "$per"); do
        extra=()
        [ "$mode" = own ] && extra=(--mca orte_tmpdir_base "$work/base.$w.$i")
        timeout 60 mpirun --oversubscribe "${extra[@]}" -np 1 /bin/true >/dev/null 2>"$work/err.$w.$i" || echo failed
    done) >"$work/result.$w" &
done
wait $(jobs -p | grep -vxF "$busy")
failed=$(cat "$work"/result.* | grep -c failed || true)
echo "$mode: $failed of $((6 * per)) mpirun jobs failed"
grep -l "File exists" "$work"/err.* 2>/dev/null | head -1 | xargs -r cat
