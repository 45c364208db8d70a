#!/usr/bin/env bash
# Prepare what tests/tools/cuda_check.sh needs on the GPU machine, HERE (a machine with pip
# and git, before the device call): the wheels the H200 image lacks in .whl/ and the
# pre-port tree (commit 64e403f, the llama-only CUDA path) in .before/ for the "before"
# benchmark. Both folders are ignored by git (.git/info/exclude) and travel with
# `carry: [".whl", ".before"]` (about 3 MB together).
set -euo pipefail
cd "$(dirname "$0")/../.."
EXCL=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCL")"
for d in /.whl/ /.before/; do grep -qxF "$d" "$EXCL" 2>/dev/null || echo "$d" >> "$EXCL"; done
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl gguf==0.19.0 msgspec==0.23.0 platformdirs==4.14.9 google-crc32c==1.9.0
rm -rf .before && mkdir .before
git archive "${BEFORE_COMMIT:-64e403f}" | tar -x -C .before
ls .whl && du -sh .whl .before
