#!/usr/bin/env bash
# Prepare, HERE (a machine with pip), what tests/tools/mmq_bench.sh needs on the GPU machine: the
# wheels its image lacks (gguf, msgspec, platformdirs, google-crc32c) in .whl/, ignored by git and
# carried with the call: carry [".whl"].
set -euo pipefail
cd "$(dirname "$0")/../.."
EXCL=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCL")"
grep -qxF "/.whl/" "$EXCL" 2>/dev/null || echo "/.whl/" >> "$EXCL"
if [ ! -d .whl ] || ! ls .whl/gguf-*.whl >/dev/null 2>&1; then
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl gguf==0.19.0 msgspec==0.23.0 platformdirs==4.14.9 google-crc32c==1.9.0
fi
ls .whl && du -sh .whl
