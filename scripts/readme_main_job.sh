#!/usr/bin/env bash
# Print the commands of the README's main-job section (the fenced block under "## The main job"),
# one per line, as written there; .ci/run runs each of them, in this order.
set -euo pipefail
cd "$(dirname "$0")/.."
awk '/^## /{section = ($0 == "## The main job")}
     section && /^```/{if (fenced) exit; fenced = 1; next}
     section && fenced && NF' README.md
