#!/usr/bin/env bash
# Prepare what tests/tools/cuda_check_gateway.sh needs on the GPU machine, HERE (pip and
# network, before the device call): the wheels the H200 image lacks (its package list:
# /work/.library/device/KINDS.md), in .whl-gw/ (ignored by git through .git/info/exclude;
# carried with `carry: [".whl-gw"]`, about 25 MB). Versions are the ones the tests ran with.
set -euo pipefail
cd "$(dirname "$0")/../.."
EXCL=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCL")"
grep -qxF "/.whl-gw/" "$EXCL" 2>/dev/null || echo "/.whl-gw/" >> "$EXCL"
rm -rf .whl-gw && mkdir .whl-gw
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl-gw \
  gguf==0.19.0 msgspec==0.23.0 platformdirs==4.14.9 google-crc32c==1.9.0 llguidance==1.9.1 \
  starlette==0.52.1 uvicorn==0.54.0 openai==2.54.0 pydantic==2.14.4 pydantic_core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 distro==1.9.0 jiter==0.19.0 \
  sniffio==1.3.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
ls .whl-gw && du -sh .whl-gw
