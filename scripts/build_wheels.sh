#!/usr/bin/env bash
# kvcore's release wheels: the manylinux wheels of the mypyc-compiled build, one per CPython
# (3.10-3.14, x86_64 on an x86_64 host, aarch64 on an aarch64 one), built with cibuildwheel in
# its manylinux containers and configured by [tool.cibuildwheel] in pyproject.toml:
# KVCORE_COMPILE=1 (a wheel that cannot compile fails instead of shipping the pure-Python
# package), auditwheel's repair, then each wheel is installed with its dependencies (torch's CPU
# build) in a fresh venv, must import as the compiled build (kvcore.__compiled__) and replays 20
# requests of the shipped trace.  Add the sdist with `python -m build --sdist` (it compiles
# where it is installed, or falls back to pure Python).
#
#   bash scripts/build_wheels.sh [OUTDIR]           (default: dist/wheels)
#
# Needs cibuildwheel (`pip install cibuildwheel`, or $CIBUILDWHEEL naming it) and a running
# Docker or Podman (CIBW_CONTAINER_ENGINE=podman); the containers download the manylinux images
# and the build and test requirements.  Without them it stops at once and says what is missing.
# `cibuildwheel --print-build-identifiers --platform linux` lists what it would build.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-"$root/dist/wheels"}
case $out in /*) ;; *) out="$PWD/$out" ;; esac

cibw=${CIBUILDWHEEL:-$(command -v cibuildwheel || true)}
if [ -z "$cibw" ] && [ -x "$root/.venv/bin/cibuildwheel" ]; then
    cibw="$root/.venv/bin/cibuildwheel"
fi
[ -n "$cibw" ] || { echo "build_wheels.sh: cibuildwheel is not installed (pip install cibuildwheel)" >&2; exit 1; }

engine=${CIBW_CONTAINER_ENGINE:-docker}
engine=${engine%%;*}  # "docker; create_args: ..." names the engine first
command -v "$engine" > /dev/null || {
    echo "build_wheels.sh: the manylinux containers need $engine, which is not installed" >&2; exit 1; }
"$engine" info > /dev/null 2>&1 || {
    echo "build_wheels.sh: $engine cannot reach its daemon ('$engine info' fails): start it first" >&2
    exit 1; }

echo "::: building into $out:"
(cd "$root" && "$cibw" --print-build-identifiers --platform linux . | sed 's/^/    /')
start=$(date +%s)
(cd "$root" && "$cibw" --platform linux --output-dir "$out" .)
echo "::: built in $(( $(date +%s) - start ))s:"
ls -1 "$out"/kvcore-*.whl
