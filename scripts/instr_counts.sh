#!/usr/bin/env bash
# Instructions per `kvcore bench manager` scenario, this tree's build against another's, counted
# by valgrind (callgrind): a deterministic comparison where the bench's CPU times on a shared VM
# vary by a few percent from run to run (an A/A run of one build against itself shows up to
# 1.05x on a row; BENCHMARKS.md, issue 37).  Counts are not times: a change of code layout or
# cache behaviour moves times without moving counts, so this complements the bench.
#
#   bash scripts/instr_counts.sh BASELINE_PYTHON [INDEX ...]
#
# BASELINE_PYTHON: an interpreter whose kvcore is the other tree (e.g. a venv with
# `KVCORE_COMPILE=1 pip install --no-deps` of it, or a pure one).  This tree's interpreter is
# $KVCORE_PYTHON (default .venv-compiled/bin/python: the compiled build; .venv/bin/python for
# the pure one).  INDEX: scenario numbers in kvcore.bench.workloads.manager_cycle.SCENARIOS
# (default: all).  $REQUESTS (default 400) is the bench's --requests.
#
# Collected: everything inside the manager's four calls (get_computed_blocks, allocate_slots,
# record_prefix_cache_stats, free), plus Request.append_output_token_ids in the decode rows and
# the request block hasher in the hashing-timed rows, as the bench times them.  Counting is
# switched on at entry to those functions by their compiled (mypyc) symbol names, so both
# interpreters must run a compiled kvcore, or both a pure one, which is counted inside the
# CPython interpreter loop instead (slow, and the toggles then never fire: every count is 0 and
# the script says so).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
[ "$#" -ge 1 ] || { sed -n '2,22p' "$0"; exit 2; }
base_py=$1; shift
new_py=${KVCORE_PYTHON:-"$root/.venv-compiled/bin/python"}
requests=${REQUESTS:-400}
command -v valgrind > /dev/null || { echo "valgrind is not installed" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$root/kvcore/bench/workloads" "$work/workloads"
count=$("$new_py" -c "import sys; sys.path.insert(0, '$work')
from workloads.manager_cycle import SCENARIOS; print(len(SCENARIOS))")
indexes=("$@")
[ "${#indexes[@]}" -gt 0 ] || mapfile -t indexes < <(seq 0 $((count - 1)))

entry=(CPyPy_kvcore___manager___KVCacheManager___get_computed_blocks
       CPyPy_kvcore___manager___KVCacheManager___allocate_slots
       CPyPy_kvcore___manager___KVCacheManager___record_prefix_cache_stats
       CPyPy_kvcore___manager___KVCacheManager___free)
decode=(CPyPy_kvcore___request___Request___append_output_token_ids)
# (The hasher's symbol follows its module: kvcore.request since issue 37, kvcore.hashing before.)
hasher=(CPyPy_kvcore___request___RequestBlockHasher_____call__
        CPyPy_hashing___RequestBlockHasher_____call__)

count_one() {  # python index -> "instructions<TAB>scenario<TAB>what the loop did"
    local py=$1 i=$2 toggles=() f extra=()
    local kind
    kind=$("$py" -c "import sys; sys.path.insert(0, '$work')
from workloads.manager_cycle import SCENARIOS as S; s = S[$i]
print('hash' if s.hash_timed else 'decode' if s.decode else 'plain')")
    case $kind in decode) extra=("${decode[@]}") ;; hash) extra=("${hasher[@]}") ;; esac
    for f in "${entry[@]}" "${extra[@]}"; do toggles+=("--toggle-collect=$f"); done
    local log="$work/log.$$.$RANDOM"
    (cd / && PYTHONHASHSEED=0 PYTHONSAFEPATH=1 valgrind --tool=callgrind --collect-atstart=no \
        "${toggles[@]}" --callgrind-out-file=/dev/null "$py" "$root/scripts/instr_cycle.py" \
        "$work" "$i" "$requests" > "$log" 2>&1) || { cat "$log" >&2; return 1; }
    printf '%s\t%s\n' "$(awk '/Collected :/ {print $4}' "$log")" "$(grep -v '^==' "$log" | tail -1)"
}

printf 'instructions per scenario (valgrind callgrind, --requests %s)\n' "$requests"
printf 'this tree: %s\nbaseline:  %s\n\n' "$new_py" "$base_py"
printf '%3s  %14s  %14s  %7s  %s\n' "#" "this tree" "baseline" "ratio" "scenario"
zero=0
for i in "${indexes[@]}"; do
    IFS=$'\t' read -r n_new name_new did_new < <(count_one "$new_py" "$i")
    IFS=$'\t' read -r n_base _ did_base < <(count_one "$base_py" "$i")
    [ "$n_new" != 0 ] && [ "$n_base" != 0 ] || zero=1
    ratio=$(awk -v a="$n_new" -v b="$n_base" 'BEGIN {printf (b > 0 ? "%.4f" : "n/a"), a / b}')
    note=""
    [ "$did_new" = "$did_base" ] || note="  (the loops differ: $did_new vs $did_base)"
    printf '%3s  %14s  %14s  %7s  %s%s\n' "$i" "$n_new" "$n_base" "$ratio" "$name_new" "$note"
done
[ "$zero" = 0 ] || { echo "a count is 0: run both trees compiled (see the header)" >&2; exit 1; }
