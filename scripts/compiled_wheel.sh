#!/usr/bin/env bash
# Build kvcore's mypyc-compiled wheel from this working tree once, for every venv that installs
# the compiled build (scripts/test_compiled.sh, scripts/vllm_compiled.sh: set
# KVCORE_COMPILED_WHEEL to the path this prints on its last line, and they install it instead
# of compiling again) and for tests/test_compiled_wheel.py.  It is the wheel a user gets from
# `pip wheel .`: KVCORE_COMPILE unset, the backend's default (compiled where a C compiler is
# present); the build runs in pip's isolated build environment (setuptools, mypy).  A wheel
# that came out pure Python (the build could not compile) is an error here.
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
# -v: pip shows the build's output, where the backend's one line says why it fell back
(cd "$root" && env -u KVCORE_COMPILE "$py" -m pip wheel -v --no-deps -w "$out" . > "$out/build.log" 2>&1) || {
    tail -n 40 "$out/build.log" >&2; echo "building the wheel failed (log: $out/build.log)" >&2; exit 1; }
wheel=$(ls "$out"/kvcore-*.whl)
case $wheel in
    *-none-any.whl)
        grep "kvcore: building the pure-Python package" "$out/build.log" >&2 || true
        echo "$wheel is the pure-Python package: this machine did not compile kvcore" >&2
        exit 1 ;;
esac
echo "$wheel"
