#!/usr/bin/env bash
# Regenerate the stock fixture of vLLM VERSION's conformance suite: run vLLM's own tests (the
# files of kvcore_pytest/vllm_conformance/files.txt) stock, without kvcore, and commit their
# outcomes as kvcore_pytest/vllm_conformance/stock/VERSION.json.  The conformance suite
# (scripts/vllm_conformance.sh) then runs only the kvcore side and reruns stock just for the
# tests kvcore does not pass.  Rerun this whenever the version's pinned sdist, its venv's pins
# or files.txt change (the suite refuses a fixture made for another version or file list).
#
#   bash scripts/vllm_stock_fixture.sh VERSION [RUNNER OPTIONS...]     (e.g. --jobs 2)
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: bash scripts/vllm_stock_fixture.sh VERSION [OPTIONS...]" >&2; exit 2; }
version=$1
shift
exec bash "$(dirname "$0")/vllm_conformance.sh" "$version" --write-stock-fixture "$@"
