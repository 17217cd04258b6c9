#!/usr/bin/env bash
# Build kvcore's mypyc-compiled wheel from this working tree once, for every venv that installs
# the compiled build (scripts/test_compiled.sh, scripts/vllm_compiled.sh: set
# KVCORE_COMPILED_WHEEL to the path this prints on its last line, and they install it instead
# of compiling again).  The build runs in pip's isolated build environment (setuptools, mypy).
#
#   bash scripts/compiled_wheel.sh [OUTDIR]        (default: .whl/compiled)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-"$root/.whl/compiled"}
case $out in /*) ;; *) out="$PWD/$out" ;; esac
py=${KVCORE_BASE_VENV:-"$root/.venv"}/bin/python
[ -x "$py" ] || { echo "no dev venv at ${py%/bin/python} (pip install -e '.[dev]' first)" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out"
(cd "$root" && KVCORE_COMPILE=1 "$py" -m pip wheel --quiet --no-deps -w "$out" . 2>&1 \
    | { grep -v "is ignored: it is neither a file nor a directory" || true; })
wheel=$(ls "$out"/kvcore-*.whl)
echo "$wheel"
