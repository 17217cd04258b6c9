#!/usr/bin/env bash
# The mypyc-compiled kvcore beside the full vLLM venv, for the no-model scheduler replay's
# compiled column:
#
#   bash scripts/vllm_compiled.sh [REPLAY_ARGS...]
#   KVCORE_VLLM_VENV=.vllm033-venv bash scripts/vllm_compiled.sh [REPLAY_ARGS...]   (vLLM 0.33)
#
# builds VENV-compiled (default .vllm-venv-compiled: the full vLLM venv's interpreter and
# packages, or those of $KVCORE_VLLM_VENV, reached through a .pth file, plus
# `KVCORE_COMPILE=1 pip install --no-deps .` of this tree, or the wheel $KVCORE_COMPILED_WHEEL
# that scripts/compiled_wheel.sh built), checks that it
# imports the compiled build, then runs `python -m kvcore.integrations.vllm.replay REPLAY_ARGS`
# in it (outside the repository and with PYTHONSAFEPATH=1, so the sources do not shadow it).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
base=${KVCORE_VLLM_VENV:-"$root/.vllm-venv"}
case $base in /*) ;; *) base="$root/$base" ;; esac
base=${base%/}
venv="$base-compiled"
[ -x "$base/bin/python" ] || { echo "no vLLM venv at $base: bash scripts/vllm_full.sh (0.32) or scripts/vllm_033.sh (0.33)" >&2; exit 1; }
[ -x "$venv/bin/python" ] || "$base/bin/python" -m venv "$venv"
py="$venv/bin/python"
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$base/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    > "$site/_kvcore_vllm_dependencies.pth"
if [ -n "${KVCORE_COMPILED_WHEEL:-}" ]; then  # built once by scripts/compiled_wheel.sh
    echo "::: compiled build: $KVCORE_COMPILED_WHEEL"
    "$py" -m pip install --quiet --no-deps --force-reinstall "$KVCORE_COMPILED_WHEEL"
else
    echo "::: compiled build (KVCORE_COMPILE=1 pip install --no-deps .)"
    (cd "$root" && KVCORE_COMPILE=1 "$py" -m pip install --quiet --no-deps --force-reinstall . 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; })
fi
export PYTHONSAFEPATH=1
cd /
"$py" -c 'import kvcore, sys; assert kvcore.__compiled__, kvcore.__file__; print("compiled kvcore:", kvcore.__file__, file=sys.stderr)'
[ "$#" -eq 0 ] && exit 0
exec "$py" -m kvcore.integrations.vllm.replay "$@"
