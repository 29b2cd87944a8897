#!/usr/bin/env bash
# Plugin API compatibility: plugins as their authors published them, installed the way a user installs
# them, into a fresh virtual environment, on today's core, one after the other. Checks:
#   1. the example as published for hicache-core 0.1 (tests/compat/pageblob-0.1, from commit a41aafa; it
#      pins hicache-core>=0.1) installs and loads: `hicache plugins` lists it, loaded, compatible;
#   2. dispatch reaches it, and its bytes land where its layout says;
#   3. its own tests and hicache's conformance kit, as it wrote them in 0.1, pass, except what
#      docs/plugin-versions.md lists as changed on purpose, which must fail with the documented
#      message: since 0.2.0 the kit requires a layout oracle (its page_blob_direct has none);
#   4. the example as published for 0.3 (tests/compat/pageblob-0.3, pinned hicache-core>=0.3,<0.4) loads
#      on 0.4 (the previous plugin API is still served), moves bytes, and passes its tests and the kit;
#   5. the 0.1 example pinned as 0.2's docs told authors to (hicache-core>=0.2,<0.3) is refused at load,
#      before its import, with what changed since plugin API 0.2;
#   6. a storage plugin in 0.2's style (tests/compat/blobstore-0.2: it overrides batch_exists and calls
#      get_stats on itself; its pin is a floor) loads, and its backend is refused at registration with
#      the change named; make_storage of its scheme says so.
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
copy_of() {  # a fresh copy of tests/compat/$1 at $2, without build leftovers
  rm -rf "$2" && mkdir -p "$2"
  (cd "$here/$1" && tar --exclude=build --exclude='*.egg-info' --exclude=__pycache__ -cf - .) | (cd "$2" && tar -xf -)
}
install() { "$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$1"; }
copy_of pageblob-0.1 "$work/src"
install "$work/src"
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

#: What docs/plugin-versions.md lists as changed on purpose, and the message each must fail with.
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

step "the example as published for 0.3 (pinned hicache-core>=0.3,<0.4): it loads on 0.4, moves bytes, passes the kit"
copy_of pageblob-0.3 "$work/src03"
install "$work/src03"
"$py" -m hicache_core.cli plugins >"$work/plugins03.txt"
"$py" -m hicache_core.cli plugins --json >"$work/plugins03.json"
"$py" - "$work/plugins03.json" "$work/plugins03.txt" <<'PY'
import json
import sys
import warnings

import torch

import hicache_core as hc

record = {r["name"]: r for r in json.load(open(sys.argv[1]))}["pageblob"]
assert record["status"] == "loaded" and not record["errors"], record
assert sorted(record["requires"].split(",")) == ["<0.4", ">=0.3"] and record["compatible"], record  # pip's order
served = f"requires hicache-core {record['requires']}: compatible (written for plugin API 0.3, which 0.4 still serves"
assert served in open(sys.argv[2]).read(), served
with warnings.catch_warnings():
    warnings.simplefilter("error")  # a 0.3 plugin that heeded 0.3's warnings meets none on 0.4
    dev = hc.MHADevicePool(96, 16, torch.bfloat16, 2, 8, 3, "cpu")
    host = hc.make_host_pool(dev, layout="page_blob_direct", io_backend="blob", size=96)
    for t in dev.k_buffer + dev.v_buffer:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    host.backup_from_device_all_layer(dev, torch.arange(16, 48), torch.arange(48, 80), "blob")
    expect = torch.stack([dev.k_buffer[2][48:64], dev.v_buffer[2][48:64]])
    assert torch.equal(host.kv_buffer[1, :, 2].view(torch.uint8), expect.view(torch.uint8))
print(f"ok: the 0.3 plugin loads on {hc.plugins.versions.core_version()} (plugin API 0.3 still served) and moves bytes")
PY
"$py" -m pytest -q -p no:cacheprovider --rootdir "$work/src03" "$work/src03/tests" >"$work/pytest03.log" 2>&1 || {
  tail -n 30 "$work/pytest03.log"; echo "the 0.3 plugin's tests or the kit failed on today's core"; exit 1; }
tail -n 1 "$work/pytest03.log"

step "the 0.1 example pinned as 0.2's docs said (hicache-core>=0.2,<0.3): refused at load, naming what changed"
copy_of pageblob-0.1 "$work/src02"
sed -i 's/"hicache-core>=0.1"/"hicache-core>=0.2,<0.3"/' "$work/src02/pyproject.toml"
grep -q '"hicache-core>=0.2,<0.3"' "$work/src02/pyproject.toml"
install "$work/src02"
"$py" -m hicache_core.cli plugins >"$work/plugins02.txt"
"$py" - "$work/plugins02.txt" <<'PY'
import sys

import torch

import hicache_core as hc
from hicache_core.plugins.registry import Registry

registry = Registry.from_entry_points()
record = registry.plugins["pageblob"]
assert record.status == "failed" and record.refused and record.layouts == [] and record.implementations == []
(error,) = record.errors
pin = record.requires  # as pip wrote it into the metadata: <0.3,>=0.2
assert sorted(pin.split(",")) == ["<0.3", ">=0.2"], pin
assert error.startswith(f"requires hicache-core {pin}, but 0.4.0 is running: refused at load"), error
assert "It was written for plugin API 0.2; changed since: 0.3: the storage page API moved off StorageBackend" in error
assert "| 0.4: " in error and error.endswith('(docs/plugins.md, "Versions")'), error
assert "hicache_pageblob" not in sys.modules, "refused before its import"
text = open(sys.argv[1]).read()
assert f"pageblob (hicache-pageblob 0.1.0): failed\n    requires hicache-core {pin}: INCOMPATIBLE\n" in text, text
assert f"error: requires hicache-core {pin}, but 0.4.0 is running: refused at load" in text
dev = hc.MHADevicePool(96, 16, torch.bfloat16, 2, 8, 3, "cpu")
try:
    hc.make_host_pool(dev, layout="page_blob_direct", io_backend="blob", size=96, registry=registry)
except Exception as exc:  # noqa: BLE001 - the message is what is checked
    assert "refused at load" in str(exc) and "written for plugin API 0.2" in str(exc), str(exc)
else:
    raise AssertionError("a refused plugin's layout was used")
print("ok: a plugin pinned to plugin API 0.2 is refused at load, before its import, naming what changed since")
PY

step "a storage plugin in 0.2's style: its backend is refused at registration, with the change named"
copy_of blobstore-0.2 "$work/blobstore"
install "$work/blobstore"
"$py" - <<'PY'
from hicache_core.plugins.registry import Registry
from hicache_core.storage import make_storage

registry = Registry.from_entry_points()
record = registry.plugins["blobstore"]
assert record.status == "loaded" and record.storage_backends == [], record
(error,) = record.errors
assert error.startswith("storage backend 'BlobStore' refused: defines BlobStore.batch_exists: 0.2's page API on a "
                        "storage backend moved to PageStore in hicache-core 0.3.0 and left the backend in 0.4.0"), error
assert "the PageStore answers prefix queries from exists_objects" in error, error
assert "BlobStore.hit_rate reads get_stats on the backend" in error and "backend_stats()" in error, error
try:
    make_storage("blobstore://x", registry=registry)
except ValueError as exc:
    assert "No storage backend serves blobstore://" in str(exc) and "defines BlobStore.batch_exists" in str(exc), exc
else:
    raise AssertionError("a 0.2-style backend was opened")
print("ok: a 0.2-style storage backend is refused at load, saying what changed and how to port it")
PY
