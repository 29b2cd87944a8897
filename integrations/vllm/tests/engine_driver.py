"""Runs vLLM's own offline engine (``vllm.LLM``) through one scenario and writes what it saw as JSON.

A separate process per engine (vLLM spawns its EngineCore and Worker processes, which needs a main
module): ``python engine_driver.py MODE OUT MODEL [STORAGE_URL]``, MODE one of

* ``baseline``: no connector;
* ``hicache``: HicacheOffloadingSpec (with L3 at STORAGE_URL when given);
* ``corrupt``: the negative control's spec (random bytes on every load);
* ``restart``: HicacheOffloadingSpec over STORAGE_URL in a fresh engine: the prefix first, from L3;
* ``reload``: HicacheOffloadingSpec over STORAGE_URL; after "A again", the weights are reloaded in place
  from ``HICACHE_TEST_RELOAD_TO`` (``collective_rpc("reload_weights")``, then vLLM's own
  ``reset_prefix_cache()``), and A is sent once more ("A after reload"); no batch.

The ``hicache`` engine with L3 also publishes KV events: vLLM's own (``kv_events_config``, its GPU and host
tiers) and hicache's (``HICACHE_KV_EVENTS``, the L3 tier), each on its own port. This process subscribes to
both with real SUB sockets from before the engine starts, and at the end records every batch (asked for
again from sequence 0 on each replay socket, so none is missed), decoded with vLLM's own classes
(:class:`EventTap`).

Scenario: prefix A, twice (the second from vLLM's device prefix cache);
B, C, D (A leaves the 15-block device cache); A again; then a batch that does
not fit the device cache (preemptions). Greedy, fixed lengths, float32.

Each step records vLLM's metrics; with ``HICACHE_TEST_S3_METRICS`` (the SeaweedFS server's Prometheus
URL) and ``HICACHE_TEST_S3_BUCKET`` also the objects and bytes the S3 server sent from that bucket so far.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).parent))

from tiny_model import prompt_ids  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import KVEventsConfig

BLOCK = 32
DEVICE_BLOCKS = 16  # one is vLLM's null block: 15 usable, 480 tokens
#: The blocks actually asked of the engine: DEVICE_BLOCKS, or as many as give this CPU's engine the same
#: 480 tokens of device cache (tests/conftest.py's fit_device_blocks derives it from the engine's own report).
ENGINE_BLOCKS = int(os.environ.get("HICACHE_TEST_DEVICE_BLOCKS", DEVICE_BLOCKS))
MAX_MODEL_LEN = 384
# The prefix; the MLA run takes one that is not a whole number of blocks (see test_mla_model_reloads_byte_exact).
PREFIX = int(os.environ.get("HICACHE_TEST_PREFIX", "256"))
GEN = 16
BATCH = [prompt_ids(100 + i, 64) for i in range(8)]
BATCH_GEN = 160


class EventTap:
    """Both KV-event streams of one engine, received as a router receives them.

    A thread holds a SUB socket on each publisher from before the engine starts (PUB drops what it sends
    before a subscriber connects); :meth:`record` stops it, asks each replay socket for every batch from
    sequence 0 (vLLM's protocol: an 8-byte start, the batches, the end marker -1), and decodes them with
    ``vllm.distributed.kv_events.KVEventBatch``.
    """

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self) -> None:
        from hicache_core.testing.servers import free_port

        self.ports = {name: (free_port(), free_port()) for name in ("vllm", "hicache")}
        self.live: dict[str, list[tuple[int, bytes]]] = {name: [] for name in self.ports}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def env(self) -> dict[str, str]:
        """hicache's settings: its publisher and replay socket (the worker's store publishes there)."""
        pub, replay = self.ports["hicache"]
        return {"HICACHE_KV_EVENTS": f"tcp://*:{pub}", "HICACHE_KV_EVENTS_REPLAY": f"tcp://*:{replay}"}

    def vllm_config(self) -> KVEventsConfig:
        """vLLM's own events (its scheduler's publisher: the GPU tier, and the offloading manager's host tier)."""
        from vllm.config import KVEventsConfig

        pub, replay = self.ports["vllm"]
        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{pub}",
                              replay_endpoint=f"tcp://*:{replay}")  # fmt: skip

    def _listen(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        socks = {}
        for name, (pub, _) in self.ports.items():
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(f"tcp://127.0.0.1:{pub}")
            socks[sock] = name
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                _, seq, payload = sock.recv_multipart()
                self.live[socks[sock]].append((int.from_bytes(seq, "big"), payload))
        for sock in socks:
            sock.close(linger=0)

    def _replay(self, port: int) -> list[tuple[int, bytes]]:
        import zmq

        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        out = []
        try:
            while True:
                if not dealer.poll(30_000):
                    raise TimeoutError(f"no end of replay from port {port}")
                _, _, seq, payload = dealer.recv_multipart()
                if seq == self.END_SEQ:
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)

    def record(self) -> dict:
        """Per stream: every event (type, medium, block hashes, locality, ownership), how many batches the SUB
        socket got, and whether each was byte for byte the replay's batch of the same number."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self._stop.set()
        self._thread.join()
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        out = {}
        for name, (_, replay_port) in self.ports.items():
            batches = self._replay(replay_port)
            by_seq = dict(batches)
            events = [{"type": type(e).__name__, "medium": getattr(e, "medium", None),
                       "hashes": list(getattr(e, "block_hashes", [])), "locality": getattr(e, "locality", None),
                       "ownership": getattr(e, "ownership", None)}
                      for _, payload in batches for e in decoder.decode(payload).events]  # fmt: skip
            out[name] = {"events": events, "seqs": [seq for seq, _ in batches], "live": len(self.live[name]),
                         "live_as_replayed": all(by_seq.get(seq) == p for seq, p in self.live[name])}  # fmt: skip
        return out


def engine_args(mode: str, model: str, storage_url: str | None) -> dict:
    from vllm.config import KVTransferConfig

    args = dict(model=model, block_size=BLOCK, num_gpu_blocks_override=ENGINE_BLOCKS, max_model_len=MAX_MODEL_LEN,
                max_num_seqs=4, max_num_batched_tokens=512, enable_prefix_caching=True,
                dtype=os.environ.get("HICACHE_TEST_DTYPE", "float32"),
                seed=0, disable_log_stats=False, enforce_eager=True)  # fmt: skip
    if mode == "baseline":
        return args
    extra = {"spec_module_path": "hicache_vllm", "spec_name": "HicacheOffloadingSpec", "cpu_bytes_to_use": 64 << 20}
    if mode == "corrupt":
        extra.update(spec_module_path="corrupting_spec", spec_name="CorruptingOffloadingSpec")
    if storage_url:
        extra["hicache_storage_url"] = storage_url
    args["kv_transfer_config"] = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                  kv_connector_extra_config=extra)  # fmt: skip
    return args


#: Counters also recorded per label value (``name{label=value}``), beside their sum under ``name``.
BY_LABEL = {"vllm:prompt_tokens_cached_by_source": "source"}


def metrics(llm) -> dict:
    out: dict = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            out[m.name] = out.get(m.name, 0) + value
            label = BY_LABEL.get(m.name)
            if label is not None:
                key = f"{m.name}{{{label}={m.labels.get(label)}}}"
                out[key] = out.get(key, 0) + value
    return out


def s3_sent() -> dict | None:
    """What the SeaweedFS server sent for the test's bucket so far, by its own metrics (``None``: no S3 here).

    ``objects``: GETs that sent a body (SeaweedFS counts a HEAD as a GET request, but a HEAD sends no
    first byte); ``bytes``: the bodies' bytes.
    """
    url, bucket = os.environ.get("HICACHE_TEST_S3_METRICS"), os.environ.get("HICACHE_TEST_S3_BUCKET")
    if not url:
        return None
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()

    def total(*want: str) -> int:
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in lines if all(w in line for w in want))

    bucket_label = f'bucket="{bucket}"'
    return {"objects": total("SeaweedFS_s3_time_to_first_byte_millisecond_count{", bucket_label, 'type="GET"'),
            "bytes": total("SeaweedFS_s3_bucket_traffic_sent_bytes_total{", bucket_label)}  # fmt: skip


def main() -> None:
    mode, out_path, model = sys.argv[1], sys.argv[2], sys.argv[3]
    storage_url = sys.argv[4] if len(sys.argv) > 4 else None
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    args = engine_args(mode, model, storage_url)
    tap = None
    if mode == "hicache" and storage_url:  # test_engine.test_l3_events_name_the_blocks_vllm_publishes
        tap = EventTap()
        os.environ.update(tap.env())  # before the engine: its processes take hicache's settings from here
        args["kv_events_config"] = tap.vllm_config()
    llm = LLM(**args)
    sp = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    a = prompt_ids(1, PREFIX)
    # What the engine made of the test's sizes on this CPU (vLLM adjusts them per attention backend).
    cache = llm.llm_engine.vllm_config.cache_config
    engine = {"block_size": cache.block_size, "prefix_caching": bool(cache.enable_prefix_caching),
              "device_blocks": ENGINE_BLOCKS}  # fmt: skip
    record: dict = {"mode": mode, "engine": engine, "steps": [], "s3_sent_before": s3_sent()}

    def run(name, prompts, params=sp):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        record["steps"].append({"name": name, "tokens": [list(o.outputs[0].token_ids) for o in outs],
                                "cached": [o.num_cached_tokens for o in outs], "metrics": metrics(llm),
                                "s3_sent": s3_sent()})  # fmt: skip

    if mode == "restart":
        run("A from L3", [a])
    run("A", [a])
    run("A twice", [a])  # from vLLM's own device prefix cache: the same compute path as a reload
    for s in (2, 3, 4):
        run(f"evict {s}", [prompt_ids(s, PREFIX)])
    run("A again", [a])
    if mode == "reload":
        llm.collective_rpc("reload_weights", kwargs={"weights_path": os.environ["HICACHE_TEST_RELOAD_TO"]})
        llm.reset_prefix_cache()  # vLLM's device prefix cache: vLLM asks for this after a weight update
        record["steps"].append({"name": "reloaded", "tokens": [], "cached": [], "metrics": metrics(llm)})
        run("A after reload", [a])
    elif not os.environ.get("HICACHE_TEST_NO_BATCH"):  # the MLA run: bf16 MLA decode on a CPU is slow
        run("batch", BATCH, SamplingParams(temperature=0, max_tokens=BATCH_GEN, ignore_eos=True))
    if tap is not None:
        record["kv_events"] = tap.record()
    Path(out_path).write_text(json.dumps(record))


if __name__ == "__main__":
    main()
