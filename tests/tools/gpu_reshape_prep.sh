#!/usr/bin/env bash
# Prepare, HERE (a machine with pip and git), what tests/tools/gpu_reshape_check.sh needs on
# the GPU machine: the wheels its image lacks in .whl/ (those of cuda_check_prep.sh) and the
# tree before the reshaping of the CUDA backend, `git archive fcf9a78`, unpacked at
# .dev/old/aotx (about 6 MB). Both are ignored by git and travel with
# `carry: [".whl", ".dev/old"]`. OLD_COMMIT=... compares against another commit.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -d .whl ] || ! ls .whl/gguf-*.whl >/dev/null 2>&1; then
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl gguf==0.19.0 msgspec==0.23.0 platformdirs==4.14.9 google-crc32c==1.9.0
fi
if [ ! -d .dev/old/aotx/engine ]; then
  rm -rf .dev/old/aotx && mkdir -p .dev/old/aotx
  git archive "${OLD_COMMIT:-fcf9a78}" | tar -x -C .dev/old/aotx
fi
ls .whl && du -sh .whl .dev/old
