"""An outsider of the cluster: a process with a NIXL agent of its own and the directory's address, no cluster key.

Run as ``python peer_outsider.py PLAN.json OUT.json``. The plan gives the directory (Redis port, the password
or ``null``, the prefix), the owner's host pool buffers (as if the attacker knew the addresses) and two
published keys. It tries, in order, and records what each attempt gave:

1. read the directory (every owner record and entry);
2. with the owner's NIXL metadata: read each host pool buffer, read the whole publication area (saved to
   ``area.bin`` beside OUT.json), read the generation words;
3. forge the directory: the entry of the first key copied under the second; an unkeyed entry for a third;
4. write: each host pool buffer, then the whole publication area and its generation words, with 0xEE.
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


def attempt(agent: PeerAgent, owner: str, local: list, remote: list, op: str) -> str:
    try:
        agent.wait(owner, agent.post(owner, local, remote, op=op), time.monotonic() + 10)
        return "ok"
    except Exception as exc:  # noqa: BLE001 - recorded: the test reads what happened
        return f"refused: {type(exc).__name__}: {exc}"[:300]


def main(plan_path: str, out_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    out: dict = {}
    client = redis.Redis(port=plan["port"], password=plan["password"], socket_timeout=5)
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
    area_bytes = slots * slot_bytes
    pool = [tuple(b) for b in plan["pool"]]
    local = torch.zeros(max([area_bytes + 8 * slots] + [n for _, n in pool]), dtype=torch.uint8)
    agent = PeerAgent(f"outsider-{time.time_ns()}")
    agent.register([(local.data_ptr(), local.numel())])
    agent.connect(owner_id, bytes(record[b"meta"]))
    base = local.data_ptr()
    out["read_pool"] = [attempt(agent, owner_id, [(base, n)], [(p, n)], "READ") for p, n in pool]
    if not agent.connected(owner_id):
        agent.connect(owner_id, bytes(record[b"meta"]))
    out["read_area"] = attempt(agent, owner_id, [(base, area_bytes)], [(area_addr, area_bytes)], "READ")
    Path(out_path).with_name("area.bin").write_bytes(local[:area_bytes].numpy().tobytes())
    out["read_gens"] = attempt(agent, owner_id, [(base, 8 * slots)], [(gens_addr, 8 * slots)], "READ")
    # Forge the directory: a sound entry copied under another key; an unkeyed entry pointing at a real slot.
    first, second, third = (f"{prefix}page:{k}" for k in plan["forge"])
    sound = client.hget(first, owner_id)
    client.hset(second, owner_id, sound)
    entry, _ = Entry.unpack(client.hget(third, owner_id))
    client.hset(third, owner_id, entry.pack())
    out["forged"] = "ok"
    local.fill_(0xEE)
    out["write_pool"] = [attempt(agent, owner_id, [(base, n)], [(p, n)], "WRITE") for p, n in pool]
    if not agent.connected(owner_id):
        agent.connect(owner_id, bytes(record[b"meta"]))
    out["write_area"] = attempt(agent, owner_id, [(base, area_bytes)], [(area_addr, area_bytes)], "WRITE")
    out["write_gens"] = attempt(agent, owner_id, [(base, 8 * slots)], [(gens_addr, 8 * slots)], "WRITE")
    agent.close()
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
