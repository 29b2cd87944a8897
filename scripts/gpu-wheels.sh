#!/usr/bin/env bash
# Wheels the GPU machine lacks (it is offline): what hicache-core and its storage plugins import beyond torch and
# triton (blake3 for the cluster key, botocore for s3://, cryptography for peer://, pyzmq and msgspec for KV
# events), at the versions CI pins, for its Python 3.12 on x86_64. Run here, then carry .whl-core in the device call; `scripts/dev gpu` installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=$(grep -hoE "^(blake3|botocore|cryptography|pyzmq|msgspec)==[^ ]+" integrations/sglang/requirements-e2e.txt \
  integrations/vllm/requirements-ci.txt | sort -u)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 \
  -d .whl-core $pins
du -sh .whl-core
