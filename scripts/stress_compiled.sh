#!/usr/bin/env bash
# Stress the mypyc-compiled build with kvcore's Hypothesis state machines (issue 26 item 8).
#
#   bash scripts/stress_compiled.sh MINUTES [LOGDIR]
#
# Runs the stateful suites (RuleBasedStateMachine tests: tests/test_manager_stateful.py,
# tests/test_pool_stateful.py, tests/test_scheduler_machine.py, and the machines in
# tests/test_eviction_policies.py and tests/test_offload.py) against the compiled build in
# .venv-compiled (build it first: bash scripts/test_compiled.sh --core), in a loop until MINUTES
# have passed (an iteration that has started finishes), one pytest process at a time (no -n), each
# iteration with a fresh --hypothesis-seed and --hypothesis-show-statistics.  PYTHONFAULTHANDLER=1,
# so a segfault prints the Python traceback of every thread; the loop stops at the first crash
# (exit status >= 128, or a pytest failure) and says so, unless KEEP_GOING=1 (then it counts them).
# To replay a crash, rerun its iteration's pytest command (same seed, same suites, same order): the
# crash of seed 247520143 in BENCHMARKS.md (issue 26 item 8) replayed that way.
#
# HYPOTHESIS_PROFILE (tests/conftest.py: ci, dev, thorough; default ci) sets max_examples and
# stateful_step_count for the machines that do not set their own.  Logs: LOGDIR (default
# /tmp/stress), one per iteration (iter-N-seed-S.log) and summary.log (seed, seconds, exit status,
# and the number of examples the statistics report).
set -uo pipefail

minutes=${1:?usage: stress_compiled.sh MINUTES [LOGDIR]}
logdir=${2:-/tmp/stress}
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${KVCORE_COMPILED_VENV:-"$root/.venv-compiled"}/bin/python
[ -x "$py" ] || { echo "no compiled venv at $py (bash scripts/test_compiled.sh --core first)" >&2; exit 1; }
mkdir -p "$logdir"

export PYTHONSAFEPATH=1 KVCORE_EXPECT_BUILD=compiled PYTHONFAULTHANDLER=1
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
"$py" -c 'import kvcore, sys; assert kvcore.__compiled__ is True, kvcore.__file__; print(kvcore.__file__)' \
    || { echo "the compiled build is not the one imported" >&2; exit 1; }

suites=(tests/test_manager_stateful.py tests/test_pool_stateful.py tests/test_scheduler_machine.py
        "tests/test_eviction_policies.py::TestLRUMachine" "tests/test_eviction_policies.py::TestSLRUMachine"
        "tests/test_eviction_policies.py::TestS3FIFOMachine" "tests/test_eviction_policies.py::TestARCMachine"
        "tests/test_offload.py::TestHostTierLRU" "tests/test_offload.py::TestHostTierARC"
        "tests/test_offload.py::TestNoDelay" "tests/test_offload.py::TestConnectorScheduler")

end=$(( $(date +%s) + minutes * 60 ))
i=0
total_examples=0
crashes=0
echo "# $(date -u +%FT%TZ) start: $minutes min, profile $HYPOTHESIS_PROFILE" >> "$logdir/summary.log"
while [ "$(date +%s)" -lt "$end" ]; do
    i=$((i + 1))
    seed=$(( (RANDOM << 15) | RANDOM ))
    log="$logdir/iter-$i-seed-$seed.log"
    start=$(date +%s)
    "$py" -m pytest -p no:cacheprovider --import-mode=append -q --hypothesis-seed="$seed" \
        --hypothesis-show-statistics "${suites[@]}" > "$log" 2>&1
    rc=$?
    # "- N passing, M failing, and K invalid test cases": the generate phase's line, per test.
    examples=$(grep -oE '^ *- [0-9]+ passing, ' "$log" | awk '{s += $2} END {print s + 0}')
    total_examples=$((total_examples + examples))
    line="iter=$i seed=$seed rc=$rc seconds=$(( $(date +%s) - start )) examples=$examples"
    echo "$line" | tee -a "$logdir/summary.log"
    if [ "$rc" -ne 0 ]; then
        crashes=$((crashes + 1))
        echo "CRASH: iteration $i (seed $seed) exited $rc; see $log" | tee -a "$logdir/summary.log"
        [ "${KEEP_GOING:-0}" = 1 ] || exit "$rc"
    fi
done
echo "# $(date -u +%FT%TZ) done: $i iterations, $total_examples passing examples, $crashes crashed" | tee -a "$logdir/summary.log"
