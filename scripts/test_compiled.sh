#!/usr/bin/env bash
# Build kvcore's mypyc-compiled build from this working tree into its own virtualenv and run the
# test suite against it.
#
#   bash scripts/test_compiled.sh [--core] [PYTEST_ARGS...]
#
#   --core   only kvcore's own tests: everything but tests/runner (the paged-attention engine,
#            which the compiled build does not change), the notebook test, and the tests whose
#            outcome does not depend on the build: they read the source tree (layering, the
#            README and docs/, the conformance runner's inputs), build and install their own package from
#            it (test_package, test_install_with_vllm, test_compiled_wheel), or check the text
#            of the pytest summary of a run without the vLLM peer (test_peer_summary).
#
# The venv (default .venv-compiled, or $KVCORE_COMPILED_VENV) gets the compiled kvcore from
# `KVCORE_COMPILE=1 pip install --no-deps .` (a wheel; the build needs setuptools and mypy, which
# pip installs into its isolated build environment), or installs the wheel $KVCORE_COMPILED_WHEEL
# (scripts/compiled_wheel.sh) when it is set.  Its dependencies (torch, pytest, ...) are
# the dev venv's (default .venv, or $KVCORE_BASE_VENV; built by the README's install line),
# reached through a .pth file rather than installed twice; the compiled kvcore comes first on
# sys.path, the dev venv's editable kvcore is not visible.
#
# Tests run from the repository with PYTHONSAFEPATH=1 (no current directory on sys.path, in
# pytest-xdist's workers too) and --import-mode=append, so `import kvcore` finds the compiled
# build while the tests still import as the `tests` package; the run stops if it does not.
# Then `python -m kvcore.bench manager --compiled-python .venv-compiled/bin/python` compares it.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=${KVCORE_COMPILED_VENV:-"$root/.venv-compiled"}
base=${KVCORE_BASE_VENV:-"$root/.venv"}
core=0
if [ "${1:-}" = "--core" ]; then
    core=1
    shift
fi

[ -x "$base/bin/python" ] || { echo "no dev venv at $base (pip install -e '.[dev]' first)" >&2; exit 1; }
if [ ! -x "$venv/bin/python" ]; then
    "$base/bin/python" -m venv "$venv"  # the dev venv's interpreter: the same Python
fi
py="$venv/bin/python"
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$base_site" > "$site/_kvcore_dev_dependencies.pth"
# One setuptools, the dev venv's: the venv's bundled one (65.x on Python 3.11) cannot build a
# wheel without the `wheel` package, and tests/test_package.py builds one without isolation.
if [ -d "$site/setuptools" ]; then
    "$py" -m pip uninstall -y -q setuptools
fi

start=$(date +%s)
if [ -n "${KVCORE_COMPILED_WHEEL:-}" ]; then  # built once by scripts/compiled_wheel.sh
    echo "::: compiled build: $KVCORE_COMPILED_WHEEL"
    "$py" -m pip install --quiet --no-deps --force-reinstall "$KVCORE_COMPILED_WHEEL"
else
    echo "::: compiled build (KVCORE_COMPILE=1 pip install --no-deps .)"
    KVCORE_COMPILE=1 "$py" -m pip install --quiet --no-deps --force-reinstall .
fi
echo "::: build and install took $(( $(date +%s) - start ))s"

export PYTHONSAFEPATH=1 KVCORE_EXPECT_BUILD=compiled  # (tests/test_build.py checks it)
"$py" - <<'EOF'
import sys

import kvcore
from kvcore.cli import version

assert kvcore.__compiled__ is True, f"{kvcore.__file__} is not the compiled build"
print(f"{version()}: {kvcore.__file__}", file=sys.stderr)
EOF

echo "::: tests against the compiled build"
args=(-p no:cacheprovider --import-mode=append -n 2)
if [ "$core" = 1 ]; then
    args+=(tests --ignore=tests/runner --deselect tests/test_notebook.py
           --ignore=tests/test_layering.py --ignore=tests/test_readme.py
           --ignore=tests/test_docs.py --ignore=tests/test_cli_docs.py
           --ignore=tests/test_vllm_conformance.py --ignore=tests/test_package.py
           --ignore=tests/test_install_with_vllm.py --ignore=tests/test_peer_summary.py
           --ignore=tests/test_compiled_wheel.py)
else
    args+=(tests)
fi
start=$(date +%s)
"$py" -m pytest "${args[@]}" "$@"
echo "::: tests took $(( $(date +%s) - start ))s"
