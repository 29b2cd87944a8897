"""An outsider of the cluster: a process with a NIXL agent of its own and the directory's address, no cluster key.

Run as ``python peer_outsider.py PLAN.json OUT.json``. The plan gives the directory (Redis port, the password
or ``null``, the prefix), the owner's host pool buffers (as if the attacker knew the addresses), three
published keys, and optionally a file of the owner's NIXL metadata in clear (as if it had leaked). It tries,
in order, and records what each attempt gave:

1. read the directory (every owner record and entry), and load the owner's NIXL metadata from it;
2. forge the directory: the entry of the first key copied under the second; an unkeyed entry for a third;
3. with the owner's metadata (the directory's if it loaded, else the leaked one): read each host pool
   buffer, read the whole publication area (saved to ``area.bin`` beside OUT.json), read the generation
   words; write each host pool buffer, then the whole area and its generation words, with 0xEE;
4. ``widened``: the metadata edited so that its registered area covers the first pool buffer, then a
   read of that buffer (UCX over TCP checks no registration at the target: NIXL's check is the reader's).
"""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import redis
import torch
from hicache_storage_peer.agent import PeerAgent
from hicache_storage_peer.directory import Entry
from redis.backoff import NoBackoff
from redis.retry import Retry


def attempt(agent: PeerAgent, owner: str, local: list, remote: list, op: str) -> str:
    try:
        agent.wait(owner, agent.post(owner, local, remote, op=op), time.monotonic() + 10)
        return "ok"
    except Exception as exc:  # noqa: BLE001 - recorded: the test reads what happened
        return f"refused: {type(exc).__name__}: {exc}"[:300]


def main(plan_path: str, out_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    out: dict = {}
    # No retries: redis-py's default backoff spends seconds on each refused call, and a refusal is the answer here.
    client = redis.Redis(port=plan["port"], password=plan["password"], socket_timeout=5, retry=Retry(NoBackoff(), 0),
                         retry_on_error=[])  # fmt: skip
    prefix = plan["prefix"]
    try:
        names = list(client.scan_iter(match=f"{prefix}*"))
        out["directory"] = "ok"
    except redis.RedisError as exc:
        out["directory"] = f"refused: {type(exc).__name__}: {exc}"
        try:
            client.hset(f"{prefix}page:x", "o", b"forged")
            out["directory_write"] = "ok"
        except redis.RedisError as exc2:
            out["directory_write"] = f"refused: {type(exc2).__name__}: {exc2}"
        Path(out_path).write_text(json.dumps(out))
        return
    owners = [n for n in names if n.startswith(f"{prefix}owner:".encode())]
    record = client.hgetall(owners[0])
    owner_id = owners[0].decode()[len(f"{prefix}owner:") :]
    area_addr, slots, slot_bytes, gens_addr = struct.unpack("<QQQQ", record[b"area"])
    out["owner"] = {"id": owner_id, "slots": slots, "slot_bytes": slot_bytes}
    # Forge the directory: a sound entry copied under another key; an unkeyed entry pointing at a real slot.
    first, second, third = (f"{prefix}page:{k}" for k in plan["forge"])
    client.hset(second, owner_id, client.hget(first, owner_id))
    entry, _ = Entry.unpack(client.hget(third, owner_id))
    client.hset(third, owner_id, entry.pack())
    out["forged"] = "ok"
    area_bytes = slots * slot_bytes
    pool = [tuple(b) for b in plan["pool"]]
    local = torch.zeros(max([area_bytes + 8 * slots] + [n for _, n in pool]), dtype=torch.uint8)
    agent = PeerAgent(f"outsider-{time.time_ns()}")
    agent.register([(local.data_ptr(), local.numel())])
    try:
        agent.connect(owner_id, bytes(record[b"meta"]))
        out["load_metadata"] = "ok"
    except Exception as exc:  # noqa: BLE001 - recorded
        out["load_metadata"] = f"refused: {type(exc).__name__}: {exc}"[:300]
    meta = bytes(record[b"meta"])
    if not agent.connected(owner_id):
        if not plan.get("leaked_metadata"):
            agent.close()
            Path(out_path).write_text(json.dumps(out))
            return
        meta = Path(plan["leaked_metadata"]).read_bytes()
        agent.connect(owner_id, meta)

    def again() -> None:
        if not agent.connected(owner_id):
            agent.connect(owner_id, meta)

    base = local.data_ptr()
    out["read_pool"] = [attempt(agent, owner_id, [(base, n)], [(p, n)], "READ") for p, n in pool]
    again()
    out["read_area"] = attempt(agent, owner_id, [(base, area_bytes)], [(area_addr, area_bytes)], "READ")
    Path(out_path).with_name("area.bin").write_bytes(local[:area_bytes].numpy().tobytes())
    out["read_gens"] = attempt(agent, owner_id, [(base, 8 * slots)], [(gens_addr, 8 * slots)], "READ")
    # The widened metadata: the area's descriptor (address, then length) moved over the first pool buffer.
    at = meta.find(struct.pack("<Q", area_addr))
    p0, n0 = pool[0]
    if at >= 0 and meta[at + 8 : at + 16] == struct.pack("<Q", area_bytes):
        widened = meta[:at] + struct.pack("<QQ", p0, n0) + meta[at + 16 :]
        spy = PeerAgent(f"outsider-w-{time.time_ns()}")
        spy.register([(local.data_ptr(), local.numel())])
        spy.connect(owner_id, widened)
        out["widened_read_pool"] = attempt(spy, owner_id, [(base, n0)], [(p0, n0)], "READ")
        Path(out_path).with_name("pool.bin").write_bytes(local[:n0].numpy().tobytes())
        spy.close()
    else:
        out["widened_read_pool"] = "no area descriptor found in the metadata"
    local.fill_(0xEE)
    out["write_pool"] = [attempt(agent, owner_id, [(base, n)], [(p, n)], "WRITE") for p, n in pool]
    again()
    out["write_area"] = attempt(agent, owner_id, [(base, area_bytes)], [(area_addr, area_bytes)], "WRITE")
    out["write_gens"] = attempt(agent, owner_id, [(base, 8 * slots)], [(gens_addr, 8 * slots)], "WRITE")
    agent.close()
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
