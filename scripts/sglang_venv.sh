#!/usr/bin/env bash
# Build the SGLang venv: sglang 0.5.23's Python package over torch 2.14.1, with only the packages
# its prefix-cache and scheduling pieces import (RadixCache, UnifiedRadixCache, the backend
# registry, the memory pools and token allocators, SchedulePolicy, PrefillAdder, Req), and kvcore
# (editable, with its test tools).  No model and no server run here: it serves kvcore's SGLang
# radix-cache backend (kvcore.integrations.sglang), its tests (tests/integrations/sglang) and its
# no-model replay (python -m kvcore.integrations.sglang.replay).
#
#   bash scripts/sglang_venv.sh [VENV_DIR]        (default: .sglang-venv in the repository root)
#
# Steps: sglang==0.5.23 --no-deps (its x86-64 wheel, 39 MB, checked against the hash below; its
# CUDA kernels and servers' dependencies are left out), then every package of
# scripts/sglang_constraints.txt (a pip freeze of a working build; it says how it was made) at
# its pinned version, torch 2.14.1 included: SGLang pins that version, and PyPI has only its
# CUDA build, which imports and runs without a GPU once its nvidia-* libraries are installed (no
# CPU wheel of 2.14.1 can be reached from here).  Then kvcore with its test extras.  About 2-4
# minutes when the torch and nvidia wheels are on local disk (measured: 3.5 minutes on a busy
# 2-core machine), and 6 GB.  Idempotent: a venv built
# from the same constraints and script (stamp file) whose SGLang imports only gets kvcore
# re-installed.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-"$root/.sglang-venv"}
case $venv in /*) ;; *) venv="$PWD/$venv" ;; esac
py="$venv/bin/python"
constraints="$root/scripts/sglang_constraints.txt"
stamp="$venv/.kvcore-sglang-stamp"
want=$(cat "$constraints" "$0" "$root/scripts/venv_lib.sh" | sha256sum | cut -d' ' -f1)
# sglang 0.5.23's cp311 x86-64 wheel on PyPI.
sglang_wheel_sha256=00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937

die() { echo "sglang_venv.sh: error: $*" >&2; exit 1; }
# shellcheck source=scripts/venv_lib.sh
. "$root/scripts/venv_lib.sh"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
[ "$(uname -m)" = x86_64 ] || die "the pinned sglang 0.5.23 wheel is x86-64's (this is $(uname -m))"
# pip's notes about absent local index folders are noise here, and so is the list of SGLang's
# requirements left out on purpose (its CUDA kernels, servers and tokenizer tools).
quiet() {
    "$@" 2>&1 | { grep -v -E "is ignored: it is neither a file nor a directory|^sglang .* requires |dependency resolver does not currently take" || true; }
    return "${PIPESTATUS[0]}"
}

kvcore() {
    quiet "$py" -m pip install --quiet -c "$constraints" -e "$root[testing]" \
        || die "installing kvcore into $venv failed"
}

smoke() {
    "$py" -W ignore::UserWarning - <<'PY'  # (its CPU-less quantization notes)
from importlib.metadata import entry_points, version

import torch
from sglang.srt.managers.schedule_policy import PrefillAdder, SchedulePolicy  # noqa: F401
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: F401
from sglang.srt.mem_cache.registry import get_radix_cache_factory
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache  # noqa: F401

import kvcore.integrations.sglang.plugin as plugin

assert version("sglang") == "0.5.23", version("sglang")
assert torch.__version__.startswith("2.14.1"), torch.__version__
names = [ep.name for ep in entry_points(group="sglang.srt.plugins")]
assert "kvcore" in names, f"kvcore's sglang.srt.plugins entry point is missing: {names}"
plugin.register()
assert get_radix_cache_factory("kvcore") is not None
print(f"SGLang venv OK (sglang {version('sglang')}, torch {torch.__version__})")
PY
}

if [ -x "$py" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] \
        && "$py" -c 'import sglang.srt.mem_cache.radix_cache' >/dev/null 2>&1; then
    echo "SGLang venv already built at $venv; re-installing kvcore"
    kvcore
    smoke || die "the SGLang venv's smoke check failed"
    exit 0
fi

fresh_venv_dir "$venv" "SGLang" || die "cannot build the venv at $venv (see above)"
echo "building the SGLang venv at $venv"
python3 -m venv "$venv" || die "python3 -m venv $venv failed"
echo "::   sglang 0.5.23 (the wheel alone, hash-checked)"
req="$venv/sglang-wheel.txt"
printf 'sglang==0.5.23 --hash=sha256:%s\n' "$sglang_wheel_sha256" >"$req"
quiet "$py" -m pip install --quiet --no-deps --only-binary=:all: -r "$req" \
    || die "installing sglang==0.5.23 failed (download, or its hash is not $sglang_wheel_sha256)"
echo "::   torch 2.14.1 and what SGLang's cache and scheduling pieces import, pinned"
quiet "$py" -m pip install --quiet -c "$constraints" -r "$constraints" \
    || die "installing the packages of $constraints failed"
echo "::   kvcore (editable) with its test tools"
kvcore
smoke || die "the SGLang venv was built but its smoke check failed (see above)"
printf '%s' "$want" >"$stamp"
echo "SGLang venv ready at $venv"
