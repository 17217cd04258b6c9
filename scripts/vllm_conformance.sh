#!/usr/bin/env bash
# vLLM's own unit tests as kvcore's conformance suite, for one vLLM release: build (or reuse)
# that release's venv, fetch its tests (scripts/vllm_tests.sh), then run them stock and with
# kvcore's schedulers and compare (python -m kvcore_pytest.vllm_conformance.run; its --help
# lists the options passed through, e.g. --jobs 2, --rerun-stock, --write-draft FILE).
#
#   bash scripts/vllm_conformance.sh VERSION [--venv-ready] [RUNNER OPTIONS...]
#
# VERSION 0.32.0 runs in .vllm-venv (scripts/vllm_full.sh), 0.33.0 in .vllm033-venv
# (scripts/vllm_033.sh).  --venv-ready skips the venv script (CI has just run it).  Exit
# status: 0 the suite passes, 1 it fails (regressions, stale exceptions, bypassed tests), 2 it
# could not run.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "vllm_conformance.sh: error: $*" >&2; exit 2; }
[ $# -ge 1 ] || die "usage: bash scripts/vllm_conformance.sh VERSION [--venv-ready] [OPTIONS...]"
version=$1
shift
case $version in
    0.32.0) venv_script=vllm_full.sh; venv="$root/.vllm-venv" ;;
    0.33.0) venv_script=vllm_033.sh; venv="$root/.vllm033-venv" ;;
    *) die "no venv for vLLM '$version' (known: 0.32.0, 0.33.0)" ;;
esac
if [ "${1:-}" = --venv-ready ]; then
    shift
    [ -x "$venv/bin/python" ] || die "--venv-ready, but $venv has no python: run bash scripts/$venv_script"
else
    bash "$root/scripts/$venv_script" || die "building $venv failed"
fi
bash "$root/scripts/vllm_tests.sh" "$version" >/dev/null || die "fetching vLLM $version's tests failed"
exec "$venv/bin/python" -m kvcore_pytest.vllm_conformance.run --vllm-version "$version" \
    --python "$venv/bin/python" --root "$root/.vllm-tests" "$@"
