#!/usr/bin/env bash
# Download, here (a machine with a package index), the cp312 manylinux x86_64 wheels the SGLang suite
# needs on the GPU machine beyond its image (requirements-gpu.txt), into .whl/ at the repository root.
# The device tool carries at most 64 MiB with the working tree; this prints the total.
#
# Then, on the GPU machine (device tool, kind nvidia-h200, carry [".whl"]):
#   integrations/sglang/dev gpu
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dest="$root/.whl"
mkdir -p "$dest"
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" --platform manylinux2014_x86_64 \
  --platform any -d "$dest" -r "$here/requirements-gpu.txt"
# One version of each: a stale wheel beside a new one stops the install there.
names=$(cd "$dest" && ls *.whl | sed -E 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort)
dups=$(echo "$names" | uniq -d)
[ -z "$dups" ] || { echo "gpu-wheels: several versions of: $dups (empty $dest and run again)" >&2; exit 1; }
du -ch "$dest"/*.whl | tail -1 | sed 's/total$/total in .whl\//'
