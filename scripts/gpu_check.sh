#!/usr/bin/env bash
# The runner's GPU check, bounded: bash scripts/gpu_check.sh [--dry-run] OUTDIR
#
# On one GPU in at most 8 minutes (the limits add up to 475 s; they are estimates
# until a GPU run has timed the steps), every step under its own time limit (a hang costs only its
# own step): the environment; the whole tests/runner (-v: each test's name in the log as it
# runs, -rf --durations=20, JUnit XML; the one test that sizes KV memory from the GPU's free
# memory runs alone after the parallel run, as other workers' memory would count against it);
# the decode attention table (batch 1/8/32/128 x 512/2k/8k/32k, FlexAttention, SDPA and
# FlashInfer columns, a split-count sweep); end-to-end throughput with async scheduling (two
# timed runs: cold and warm, and the bounded transformers column) and without; prefix caching.
# Logs and JSON go to OUTDIR; a summary table (steps, test counts with the failing names, the
# targets with this run's values) ends the output and is saved as OUTDIR/summary.md.
#
# Needs only this repository and a Python with torch (CUDA), Triton and transformers: nothing is
# installed, no package index is used.  PYTHONPATH is set to the repository; pytest-xdist and
# execnet, if the Python lacks them, come from scripts/wheels (unpacked into OUTDIR).  Python:
# $PYTHON, else python3.  Time limits (seconds) can be changed with GPU_CHECK_LIMIT_<STEP>
# (ENV, TESTS, TESTS_SERIAL, ATTENTION, THROUGHPUT_ASYNC, THROUGHPUT_SYNC, PREFIX).
#
# --dry-run: every step on tiny shapes on the CPU, Triton kernels under the interpreter
# (TRITON_INTERPRET=1), a few tests instead of the whole directory; about a minute on an idle
# 2-core machine (each step's limit is then 150 s: a loaded machine is slower).  CI runs
# it (tests/runner/test_gpu_check.py), so the script cannot rot between GPU sessions.
#
# Exit status: 0 when every step ran to completion, 1 when one failed or hit its limit, 2 on
# bad usage.  A missed performance target is reported, not an error.
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

dry=0
outdir=
for arg in "$@"; do
    case $arg in
        --dry-run) dry=1 ;;
        -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "gpu_check: unknown option $arg" >&2; exit 2 ;;
        *) [ -z "$outdir" ] || { echo "gpu_check: one OUTDIR only" >&2; exit 2; }; outdir=$arg ;;
    esac
done
[ -n "$outdir" ] || { echo "usage: bash scripts/gpu_check.sh [--dry-run] OUTDIR" >&2; exit 2; }
mkdir -p "$outdir" || exit 2
outdir=$(cd "$outdir" && pwd)
: > "$outdir/steps.tsv"

PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry" = 1 ]; then
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
fi
started=$(date +%s)

limit() {  # limit STEP DEFAULT: the GPU limit; a dry run gets 150 s a step (a busy CPU
    local var="GPU_CHECK_LIMIT_$1"  # under the interpreter is slow, and it checks code paths)
    if [ "$dry" = 1 ]; then echo "${!var:-150}"; else echo "${!var:-$2}"; fi
}

# step NAME LIMIT LOG CMD...: run CMD under its time limit, output to OUTDIR/LOG (and a tail
# here), one line in steps.tsv.
step() {
    local name=$1 secs=$2 log=$3
    shift 3
    echo "::: $name (limit ${secs}s): $*"
    local t0 rc status
    t0=$(date +%s)
    timeout --kill-after=10 "$secs" "$@" > "$outdir/$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    local took=$(( $(date +%s) - t0 ))
    tail -n 15 "$outdir/$log"
    echo "::: $name: $status (exit $rc) in ${took}s"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$took" "$secs" "$log" \
        >> "$outdir/steps.tsv"
}

# pytest-xdist from the tree when the Python lacks it (no index on the GPU machine).
if ! "$PY" -c 'import xdist' 2>/dev/null; then
    lib="$outdir/.pylib"
    mkdir -p "$lib"
    for whl in "$repo"/scripts/wheels/*.whl; do
        "$PY" -m zipfile -e "$whl" "$lib" || true
    done
    export PYTHONPATH="$PYTHONPATH:$lib"
fi
jobs=()
if [ "$dry" = 0 ] && "$PY" -c 'import xdist' 2>/dev/null; then
    jobs=(-n "${GPU_CHECK_WORKERS:-12}")
fi

env_check='
import os, platform, sys
import torch, triton
print("python", sys.version.split()[0], platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
for mod in ("transformers", "numpy", "pytest", "xdist", "flashinfer", "flash_attn"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception as exc:
        print(mod, "missing:", type(exc).__name__, exc)
print("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"))
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, "SMs", p.multi_processor_count, "memory GiB",
          round(p.total_memory / 2**30, 1))
    from runner.kernels.attention import decode_splits
    print("decode splits (8 KV heads) batch 1/8/32/128 x 32k:",
          [decode_splits(32768, b, 8, None, num_sms=p.multi_processor_count)
           for b in (1, 8, 32, 128)])
elif not os.environ.get("TRITON_INTERPRET"):
    sys.exit("no CUDA device (use --dry-run on a CPU)")
'
step env "$(limit ENV 15)" env.log "$PY" -c "$env_check"

serial_test=tests/runner/test_gpu_engine.py::test_profiled_kv_memory_respects_utilization
dry_run_test=tests/runner/test_gpu_check.py::test_dry_run_runs_every_step  # CI's, on a CPU
if [ "$dry" = 1 ]; then
    step tests "$(limit TESTS 150)" tests.log "$PY" -m pytest "${jobs[@]}" -o addopts= \
        -p no:cacheprovider -v -rf --durations=20 --junitxml="$outdir/tests.xml" \
        tests/runner/test_split_decode.py::test_h100_choices_match_the_sweeps_best_points \
        tests/runner/test_split_decode.py::test_one_split_writes_the_output_directly
    bench=(--allow-cpu)
    attention=(--backends triton,torch --batches 2 --contexts 48)
    e2e=(--backends triton --num-seqs 3)
    peer=(--peer transformers --peer-num-seqs 2 --peer-time-limit 30)
    prefix=(--backends triton)
else
    step tests "$(limit TESTS 150)" tests.log "$PY" -m pytest "${jobs[@]}" -o addopts= \
        -p no:cacheprovider -v -rf --durations=20 --junitxml="$outdir/tests.xml" tests/runner \
        --deselect "$serial_test" --deselect "$dry_run_test"
    step tests-serial "$(limit TESTS_SERIAL 25)" tests_serial.log "$PY" -m pytest -o addopts= \
        -p no:cacheprovider -v -rf --junitxml="$outdir/tests_serial.xml" "$serial_test"
    bench=()
    attention=(--backends triton --batches 1,8,32,128 --contexts 512,2048,8192,32768)
    e2e=(--backends triton)
    peer=(--peer transformers --peer-num-seqs 48 --peer-time-limit 30)
    prefix=(--backends triton)
fi

att_limit=$(limit ATTENTION 120)
step attention "$att_limit" attention.log "$PY" -m runner.bench attention "${bench[@]}" \
    "${attention[@]}" --peers flex,sdpa,flashinfer --split-sweep \
    --time-limit $(( att_limit * 3 / 4 )) --json "$outdir/attention.json"
step throughput-async "$(limit THROUGHPUT_ASYNC 90)" throughput_async.log \
    "$PY" -m runner.bench throughput "${bench[@]}" "${e2e[@]}" --runs 2 "${peer[@]}" \
    --json "$outdir/throughput_async.json"
step throughput-sync "$(limit THROUGHPUT_SYNC 40)" throughput_sync.log \
    "$PY" -m runner.bench throughput "${bench[@]}" "${e2e[@]}" --no-async-scheduling \
    --json "$outdir/throughput_sync.json"
step prefix "$(limit PREFIX 35)" prefix.log "$PY" -m runner.bench prefix "${bench[@]}" \
    "${prefix[@]}" --json "$outdir/prefix.json"

echo "::: gpu_check took $(( $(date +%s) - started ))s"
report=(-m runner.check_report)
[ "$dry" = 1 ] && report+=(--dry-run)
"$PY" "${report[@]}" "$outdir"
