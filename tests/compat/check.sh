#!/usr/bin/env bash
# Plugin API compatibility: the example plugin as published for hicache-core 0.1 (frozen in
# tests/compat/pageblob-0.1 from commit a41aafa, its first publication), installed the way a user
# installs it, into a fresh virtual environment, on today's core. Checks:
#   1. it installs and loads: `hicache plugins` lists it, loaded, compatible with its pinned range;
#   2. dispatch reaches it, and its bytes land where its layout says;
#   3. its own tests and hicache's conformance kit, as it wrote them in 0.1, pass, except what
#      docs/plugins.md ("Versions") lists as changed on purpose, which must fail with the documented
#      message: since 0.2.0 the kit requires a layout oracle (its page_blob_direct has none).
# Anything else that fails means the plugin API broke silently.
#
#   tests/compat/check.sh /path/to/env/bin/python    (an environment with hicache-core, torch, pytest, setuptools)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
base_python="${1:-python3}"
work="$(mktemp -d "${TMPDIR:-/tmp}/hicache-compat.XXXXXX")"
trap 'rm -rf "$work"' EXIT
unset HICACHE_PLUGINS PYTHONPATH
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_NO_INDEX=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
step() { printf '\n== %s\n' "$*"; }

step "fresh environment from $base_python, the 0.1 plugin installed from a copy of its source"
"$base_python" -m venv --without-pip "$work/venv"
py="$work/venv/bin/python"
site_of() { "$1" -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' | sort -u; }
new_site="$(site_of "$py" | head -n 1)"
for dir in $(site_of "$base_python"); do
  echo "import site; site.addsitedir('$dir')" >>"$new_site/_hicache_base_env.pth"
done
mkdir "$work/src"
(cd "$here/pageblob-0.1" && tar --exclude=build --exclude='*.egg-info' --exclude=__pycache__ -cf - .) | (cd "$work/src" && tar -xf -)
"$py" -m pip install -q --no-deps --no-build-isolation "$work/src"
cd "$work"

step "it loads, and dispatch reaches it"
"$py" -m hicache_core.cli plugins --json >"$work/plugins.json"
"$py" - "$work/plugins.json" <<'PY'
import json
import sys
import warnings

import torch

import hicache_core as hc

records = {r["name"]: r for r in json.load(open(sys.argv[1]))}
record = records.get("pageblob")
assert record is not None, f"hicache plugins does not list the 0.1 plugin: {sorted(records)}"
assert record["status"] == "loaded" and not record["errors"], record
assert record["requires"] == ">=0.1" and record["compatible"], record
assert record["layouts"] == ["page_blob_direct"] and [i["name"] for i in record["implementations"]] == ["pageblob.gather"]
with warnings.catch_warnings():
    warnings.simplefilter("error")  # a 0.1 plugin that hits a deprecated name says so; this one uses none
    dev = hc.MHADevicePool(96, 16, torch.bfloat16, 2, 8, 3, "cpu")
    host = hc.make_host_pool(dev, layout="page_blob_direct", io_backend="blob", size=96)
    assert set(host.implementations.values()) == {"pageblob.gather"}, host.implementations
    for t in dev.k_buffer + dev.v_buffer:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    h, d = torch.arange(16, 48), torch.arange(48, 80)
    host.backup_from_device_all_layer(dev, h, d, "blob")
    expect = torch.stack([dev.k_buffer[1][48:64], dev.v_buffer[1][48:64]])
    assert torch.equal(host.kv_buffer[1, :, 1].view(torch.uint8), expect.view(torch.uint8))
print(f"ok: the 0.1 plugin loads (requires hicache-core {record['requires']}: compatible) and moves bytes: {host}")
PY

step "its tests and the kit, as written for 0.1"
set +e
"$py" -m pytest -q -p no:cacheprovider --rootdir "$work/src" "$work/src/tests" --junitxml "$work/results.xml" \
  >"$work/pytest.log" 2>&1
set -e
tail -n 3 "$work/pytest.log"
"$py" - "$work/results.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET

#: What docs/plugins.md ("Versions") lists as changed on purpose, and the message each must fail with.
CHANGED = {
    "test_declaration": "declares no oracle",
    "test_layout_matches_its_oracle": "declares no oracle",
}
passed, expected, broken = 0, [], []
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    name = case.get("name").split("[")[0]
    failure = case.find("failure")
    if failure is None:
        failure = case.find("error")
    if failure is None:
        passed += case.find("skipped") is None
        continue
    text = (failure.get("message") or "") + (failure.text or "")
    wanted = CHANGED.get(name)
    if wanted and wanted in text and "Since hicache-core 0.2.0" in text and "page_blob_direct" in text:
        expected.append(case.get("name"))
    else:
        broken.append(f"{case.get('classname')}::{case.get('name')}: {text[:400]}")
assert not broken, "the 0.1 plugin broke on today's core:\n" + "\n".join(broken)
assert passed > 100 and "test_declaration" in expected, (passed, expected)
print(f"ok: {passed} of its 0.1 tests pass; {len(expected)} fail as documented (the kit requires an oracle since 0.2.0)")
PY
