"""The stored form of a page, pinned: the exact bytes and keys a store receives never change by accident.

The vectors below were taken from hicache-core 0.2.0 (the last version where the backend was also the
page store) and must hold for every later version that reads format 2: pages already in users' stores
(files, Redis, Mooncake) are read by key and checked byte by byte, so a change here is a format change
(a new format version, a note in docs/plugin-storage.md), never a refactoring.
"""

from __future__ import annotations

import hashlib
import uuid

import pytest
import torch

from hicache_core.storage import make_storage, page_hashes
from hicache_core.testing import cases as C
from hicache_core.testing.storage_kit import StorageCase, make_pool, slots_of

CASE = StorageCase("mha", "page_first", "plain", 4)
MODEL = "pinned/model"
TOKENS = list(range(100, 112))  # three pages of four tokens

#: The namespace of the pool's keys: model, geometry fingerprint, rank share.
NAMESPACE = "pinned_model.m2-9d44c6f60d4fe44fd6c23f14.d0bc041720adf06e1a095029eef4d7dc.tp0of1"
#: SGLang's page hashes of the three pages (the key is ``NAMESPACE/hash``).
HASHES = [
    "9d373db168e3e6a03e12ea791ce33b00590b4652dd4618889639c8095ac017f7",
    "ba16f22309bf4813eb11f38cd4bbe8797d6020c94bedf8172295626dbe0105a2",
    "903f67facce6cd222fb4acf099f685a40ba6bce34dbc22faec4dbe2f56ed179b",
]
#: The 80-byte header of the first page.
HEADER0 = (
    "48494350020050000100000000030000000000005320137c0a3b15cad0bc041720adf06e1a095029"
    "eef4d7dc40574cf65b58607410d58ff31a57463a94566fb9f909a31f2b86fceefcdc1eed37d0c9a0"
)
#: SHA-256 of each whole stored object (header, then payload).
OBJECTS = [
    "144b0e08c3ef54df049644799c19fd5f68cf0fea82096d8de8449cc557c8a9ad",
    "4333cc1bb6bbb3346d0b7678d03d0a579758ab633fea8512f51ed6090fe894e4",
    "e683d68ad8cc19c1e54748fcdb0e138b609ae5c300b0d6b7969e11ed9a36a44c",
]
#: SHA-256 of what ``set`` stores for a flat page.
FLAT_OBJECT = "fb70152ae10f3b30c73d15376fb48de11102d57fb4bbe63c49d70524f8dd9616"
#: SHA-256 of each page's file under file:// (the header padded to one 4 KiB block, then the payload).
FILES = [
    "82c059a381e70f89c1fd8ea81ccd12a922a90c98bc8e4e05d14bacda14f8ba88",
    "3936a6d19f337459b4b95a4d940caf9b19a439187b70374b994eaf758912de4f",
    "ba7f9794bc00456d8894497ee69dbd865f51ad49f4d173d93355079da55f9a2c",
]


def _pool():
    host = make_pool(CASE, pages=8, seed=0)
    for i, tensor in enumerate(host.plan.host_buffers.values()):  # a fixed pattern, not the kit's random bytes
        raw = C.as_bytes(tensor)
        raw.copy_((torch.arange(raw.numel(), dtype=torch.int64) * 7 + 3 * i).remainder(251).to(torch.uint8))
    return host


def _stored(url: str):
    host = _pool()
    store = make_storage(url, host, model_id=MODEL)
    hashes = page_hashes(TOKENS, CASE.page_size)
    assert all(r.ok for r in store.write_pages(hashes, slots_of([3, 1, 6], CASE.page_size)))
    return host, store, hashes


def test_a_stored_page_is_byte_for_byte_the_pinned_vector():
    _, store, hashes = _stored(f"memory://pinned-{uuid.uuid4().hex[:8]}")
    full = store.namespace.keys(hashes)
    assert full == [f"{NAMESPACE}/{h}" for h in HASHES]
    blobs = [bytes(b) for b in store.backend.get_objects(full)]
    assert blobs[0][:80].hex() == HEADER0
    assert [hashlib.sha256(b).hexdigest() for b in blobs] == OBJECTS
    store.close()


def test_a_flat_page_is_stored_as_the_same_bytes():
    host, store, hashes = _stored(f"memory://pinned-{uuid.uuid4().hex[:8]}")
    assert store.set("f" * 64, host.get_data_page(5 * CASE.page_size, flat=True))
    (blob,) = store.backend.get_objects([store.namespace.key("f" * 64)])
    assert hashlib.sha256(bytes(blob)).hexdigest() == FLAT_OBJECT
    store.close()


def test_a_page_file_on_disk_is_byte_for_byte_the_pinned_vector(tmp_path):
    from hicache_core.plugins.registry import get_registry

    if "file" not in get_registry().storage_backends:
        pytest.skip("hicache-storage-file is not installed")
    _, store, hashes = _stored(f"file://{tmp_path}")
    paths = [store.backend.path_of(k) for k in store.namespace.keys(hashes)]
    assert paths[0].relative_to(tmp_path).as_posix() == f"{NAMESPACE}/{HASHES[0][:2]}/{HASHES[0]}.page"
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths] == FILES
    store.close()
