#!/usr/bin/env bash
# The third-party path, end to end: install this example the way a user would (pip, from its own
# pyproject.toml, found by hicache through its entry point) into a fresh virtual environment, then check
#   1. that `hicache plugins` lists it, loaded, with its layout and implementation;
#   2. that dispatch reaches it (make_host_pool(layout="page_blob_direct", io_backend="blob"));
#   3. that hicache's conformance kit, and the example's own tests, pass on the installed copy.
#
#   examples/thirdparty-plugin/ci-check.sh /path/to/env/bin/python
#
# The python given belongs to an environment where hicache-core is installed, with torch, pytest and
# setuptools. The fresh environment is made from it with `-m venv --without-pip` and sees that
# environment's packages through one .pth file (so nothing is downloaded: it works offline). The
# example reaches the fresh environment only as a wheel built from a copy of this folder.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
base_python="${1:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/hicache-thirdparty.XXXXXX")"
trap 'rm -rf "$work"' EXIT
unset HICACHE_PLUGINS PYTHONPATH
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_NO_INDEX=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # tiny tensors: threads only add contention on a busy runner
step() { printf '\n== %s\n' "$*"; }

step "fresh environment from $base_python"
"$base_python" -c 'import setuptools, hicache_core, pytest' && "$base_python" -m pip --version >/dev/null || {
  echo "ci-check: $base_python lacks hicache-core, pip, pytest or setuptools" >&2
  exit 1
}
"$base_python" -m venv --without-pip "$work/venv"
py="$work/venv/bin/python"
site_of() { "$1" -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' | sort -u; }
new_site="$(site_of "$py" | head -n 1)"
for dir in $(site_of "$base_python"); do
  echo "import site; site.addsitedir('$dir')" >>"$new_site/_hicache_base_env.pth"
done
(cd "$work" && "$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("hicache_pageblob") is not None)') ||
  echo "note: hicache_pageblob is also installed in the base environment; the checks below use the fresh copy"

step "pip install the example from a copy of its source (no dependencies, no build isolation, no index)"
mkdir "$work/src"
(cd "$here" && tar --exclude=build --exclude='*.egg-info' --exclude=__pycache__ --exclude=.pytest_cache -cf - .) |
  (cd "$work/src" && tar -xf -)
"$py" -m pip install -q --no-deps --no-build-isolation "$work/src"
cd "$work"
"$py" - <<'PY'
import sys

import hicache_pageblob

assert hicache_pageblob.__file__.startswith(sys.prefix), f"imported from {hicache_pageblob.__file__}, not {sys.prefix}"
print(f"installed at {hicache_pageblob.__file__}")
PY

step "hicache plugins lists it"
"$py" -m hicache_core.cli plugins
"$py" -m hicache_core.cli plugins --json >"$work/plugins.json"
"$py" - "$work/plugins.json" <<'PY'
import json
import sys

records = {r["name"]: r for r in json.load(open(sys.argv[1]))}
record = records.get("pageblob")
assert record is not None, f"hicache plugins does not list pageblob: {sorted(records)}"
assert record["distribution"] == "hicache-pageblob" and record["version"] == "0.1.0", record
assert record["status"] == "loaded" and not record["errors"], record
assert record["layouts"] == ["page_blob_direct"], record
assert [i["name"] for i in record["implementations"]] == ["pageblob.gather"], record
assert record["implementations"][0]["io_backend"] == "blob", record
print("ok: pageblob (hicache-pageblob 0.1.0) loaded, layout page_blob_direct, implementation pageblob.gather")
PY

step "dispatch reaches it"
"$py" -m hicache_core.cli explain --pool mha --layout page_blob_direct --op load_to_device_per_layer \
  --io-backend blob --device cpu
"$py" - <<'PY'
import torch

import hicache_core as hc

dev = hc.MHADevicePool(64, 16, torch.bfloat16, 2, 8, 3, "cpu")  # host (64 tokens) >= device, as main requires
host = hc.make_host_pool(dev, layout="page_blob_direct", io_backend="blob", size=64)
assert set(host.implementations.values()) == {"pageblob.gather"}, host.implementations
assert tuple(host.kv_buffer.shape) == (4, 2, 3, 16, 2, 8), host.kv_buffer.shape
for t in dev.k_buffer + dev.v_buffer:
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
h, d = torch.arange(16, 48), torch.arange(48, 80)
host.backup_from_device_all_layer(dev, h, d, "blob")
expect = torch.stack([dev.k_buffer[1][48:64], dev.v_buffer[1][48:64]])
assert torch.equal(host.kv_buffer[1, :, 1].view(torch.uint8), expect.view(torch.uint8))
print(f"ok: {host}")
PY

step "the conformance kit and the example's tests, on the installed copy"
"$py" -m pytest -q -p no:cacheprovider --rootdir "$work/src" "$work/src/tests"
