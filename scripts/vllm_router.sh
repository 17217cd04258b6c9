#!/usr/bin/env bash
# Build vllm-router 0.1.17 (vLLM's Rust HTTP router; its kv_aware policy subscribes to vLLM's
# ZeroMQ KV events) in its own virtualenv, for tests/test_vllm_router_interop.py.  kvcore never
# imports it: the test runs VENV_DIR/bin/vllm-router as a process.
#
#   bash scripts/vllm_router.sh [VENV_DIR]     (default: .vllm-router-venv in the repository root)
#
# Idempotent: a venv whose vllm-router reports this version is reused.
set -euo pipefail

version=0.1.17
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-"$root/.vllm-router-venv"}
installed=$("$venv/bin/python" -m pip show vllm-router 2>/dev/null || true)
if [ -x "$venv/bin/vllm-router" ] && grep -qx "Version: $version" <<< "$installed"; then
    echo "vllm-router $version already in $venv"
    exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "vllm-router==$version"
"$venv/bin/vllm-router" --help > /dev/null
echo "vllm-router $version installed in $venv"
