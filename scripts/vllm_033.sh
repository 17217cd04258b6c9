#!/usr/bin/env bash
# Build the vLLM 0.33 venv: vllm 0.33.0's Python package over torch 2.13.0 (CPU), with the
# packages vLLM imports, kvcore (editable, with its test tools) and what vLLM's unit tests
# import.  vLLM 0.33 has no CPU wheel: its wheel is the CUDA build, installed --no-deps; its
# compiled kernels are never loaded here.  No engine runs in this venv: it serves kvcore's
# adapter against vLLM 0.33 (the no-model scheduler replay, vLLM's own unit tests as the
# conformance suite).  Set VLLM_TARGET_DEVICE=cpu in it: vLLM then picks its CPU platform,
# which a VllmConfig needs.
#
#   bash scripts/vllm_033.sh [VENV_DIR]        (default: .vllm033-venv in the repository root)
#
# Steps: torch 2.13.0 (this machine kind's local CPU wheel) first; vllm==0.33.0 --no-deps
# (its x86-64 wheel, 336 MB, checked against the hash below); then every package of
# scripts/vllm_033_constraints.txt (a pip freeze of a working build, which also says how it
# was made), each at its pinned version; then kvcore with its test extras.  torch is pinned to
# 2.13.0+cpu in every pip call, so nothing can pull a CUDA torch.  About 3 minutes and 2 GB.
# Idempotent: a venv built from the same constraints and script (stamp file) whose vLLM
# imports only gets kvcore re-installed.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-"$root/.vllm033-venv"}
case $venv in /*) ;; *) venv="$PWD/$venv" ;; esac
py="$venv/bin/python"
constraints="$root/scripts/vllm_033_constraints.txt"
stamp="$venv/.kvcore-vllm033-stamp"
want=$(cat "$constraints" "$0" "$root/scripts/venv_lib.sh" | sha256sum | cut -d' ' -f1)
# vLLM 0.33.0's x86-64 wheel on PyPI (the simple index's sha256).
vllm_wheel_sha256=4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa

die() { echo "vllm_033.sh: error: $*" >&2; exit 1; }
# shellcheck source=scripts/venv_lib.sh
. "$root/scripts/venv_lib.sh"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 VLLM_TARGET_DEVICE=cpu
[ "$(uname -m)" = x86_64 ] || die "the pinned vLLM 0.33.0 wheel is x86-64's (this is $(uname -m))"
# pip's notes about absent local index folders are noise here, and so is the list of vLLM's
# requirements left out on purpose (the CUDA ones, torch 2.14) after its --no-deps install.
quiet() {
    "$@" 2>&1 | { grep -v -E "is ignored: it is neither a file nor a directory|^vllm .* requires |dependency resolver does not currently take" || true; }
    return "${PIPESTATUS[0]}"
}

kvcore() {
    quiet "$py" -m pip install --quiet -c "$constraints" -e "$root[testing]" pytest-xdist \
        || die "installing kvcore into $venv failed"
}

smoke() {
    VLLM_LOGGING_LEVEL=ERROR "$py" - <<'PY'
import torch
import vllm
from vllm.config import VllmConfig
from vllm.platforms import current_platform
from vllm.v1.core.sched.scheduler import Scheduler

import kvcore.integrations.vllm as kv

assert vllm.__version__ == "0.33.0", vllm.__version__
assert torch.version.cuda is None, f"torch is not the CPU build: {torch.__version__}"
assert current_platform.is_cpu(), f"vLLM's platform is {current_platform!r}, not the CPU one"
VllmConfig()
assert issubclass(kv.Scheduler, Scheduler)
print(f"vLLM 0.33 venv OK (vllm {vllm.__version__}, torch {torch.__version__})")
PY
}

if [ -x "$py" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] \
        && VLLM_LOGGING_LEVEL=ERROR "$py" -c 'import vllm.v1.core.sched.scheduler' >/dev/null 2>&1; then
    echo "vLLM 0.33 venv already built at $venv; re-installing kvcore"
    kvcore
    smoke || die "the vLLM 0.33 venv's smoke check failed"
    exit 0
fi

fresh_venv_dir "$venv" "vLLM 0.33" || die "cannot build the venv at $venv (see above)"
echo "building the vLLM 0.33 venv at $venv"
python3 -m venv "$venv" || die "python3 -m venv $venv failed"
echo "::   torch 2.13.0 (CPU)"
quiet "$py" -m pip install --quiet -c "$constraints" "torch==2.13.0" \
    || die "installing torch==2.13.0 failed (this machine kind's local CPU wheel is required)"
echo "::   vllm 0.33.0 (the wheel alone, hash-checked)"
req="$venv/vllm-wheel.txt"
printf 'vllm==0.33.0 --hash=sha256:%s\n' "$vllm_wheel_sha256" >"$req"
quiet "$py" -m pip install --quiet --no-deps --only-binary=:all: -r "$req" \
    || die "installing vllm==0.33.0 failed (download, or its hash is not $vllm_wheel_sha256)"
echo "::   vLLM's CPU-side dependencies and the test tools, pinned"
quiet "$py" -m pip install --quiet -c "$constraints" -r "$constraints" \
    || die "installing the packages of $constraints failed"
"$py" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' \
    || die "torch was replaced: $("$py" -c 'import torch; print(torch.__version__)')"
echo "::   kvcore (editable) with its test tools"
kvcore
smoke || die "the vLLM 0.33 venv was built but its smoke check failed (see above)"
printf '%s' "$want" >"$stamp"
echo "vLLM 0.33 venv ready at $venv"
