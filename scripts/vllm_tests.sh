#!/usr/bin/env bash
# Fetch vLLM's own tests for one release: download its source distribution from PyPI (pinned
# URL and sha256 below), verify it, and extract its tests/ and pyproject.toml (vLLM's pytest
# markers) into .vllm-tests/VERSION/src/ — never committed, never edited.  The download is kept in
# .vllm-tests/downloads/ (gitignored), so a re-run is offline and instant.
#
#   bash scripts/vllm_tests.sh VERSION         (0.32.0 or 0.33.0)
#
# Prints the extracted directory (the conformance runner's --tests-dir) on its last line.
# Idempotent: an extraction made from the same archive (stamp file) is kept as it is.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
die() { echo "vllm_tests.sh: error: $*" >&2; exit 1; }
[ $# -eq 1 ] || die "usage: bash scripts/vllm_tests.sh VERSION   (0.32.0 or 0.33.0)"
version=$1

# The PyPI simple index's files (https://pypi.org/simple/vllm/, JSON), one line per release.
case $version in
    0.32.0)
        url=https://files.pythonhosted.org/packages/d5/df/5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz
        sha256=d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad ;;
    0.33.0)
        url=https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz
        sha256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112 ;;
    *) die "no pinned source distribution for vLLM '$version' (known: 0.32.0, 0.33.0)" ;;
esac

base="$root/.vllm-tests"
archive="$base/downloads/vllm-$version.tar.gz"
dest="$base/$version/src"
stamp="$dest/.kvcore-vllm-tests-stamp"
members=(tests examples pyproject.toml)
want="$sha256 ${members[*]}"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -d "$dest/tests" ]; then
    echo "vLLM $version's tests already at $dest"
    echo "$dest"
    exit 0
fi

verified() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$sha256" ]; }
mkdir -p "$base/downloads"
if ! verified "$archive"; then
    echo "downloading vLLM $version's source distribution"
    curl -fsSL --retry 3 -o "$archive.part" "$url" || die "downloading $url failed"
    verified "$archive.part" || {
        rm -f "$archive.part"
        die "$url does not have the pinned sha256 $sha256"
    }
    mv "$archive.part" "$archive"
fi

# Extract next to the destination, then swap it in: an interrupted run leaves no half tree.
tmp="$base/$version/.extract"
rm -rf "$tmp"
mkdir -p "$tmp"
tar -xzf "$archive" -C "$tmp" --strip-components=1 "${members[@]/#/vllm-$version/}" \
    || die "extracting ${members[*]} from $archive failed"
printf '%s' "$want" >"$tmp/.kvcore-vllm-tests-stamp"
rm -rf "$dest"
mv "$tmp" "$dest"
echo "vLLM $version's tests at $dest ($(find "$dest/tests" -name 'test_*.py' | wc -l) test files)"
echo "$dest"
