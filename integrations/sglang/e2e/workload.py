"""The requests every server of the suite gets, and what the suite compares.

Device pool: 2048 tokens. A 400-token prefix is sent, then enough other 400-token
requests to push it out of the device pool to the host tier, then the prefix again (it
must come back from the host), then a batch of concurrent requests that share a second
prefix, also evicted to the host first. Outputs are greedy token ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tiny_model import FIRST_WORD, VOCAB

PREFIX_TOKENS = 400
EVICTORS = 8  # 8 x 400 tokens > the 2048-token device pool
BATCH = 24
NEW_TOKENS = 8


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_WORD, VOCAB) for _ in range(n)]


@dataclass(frozen=True)
class Prompts:
    prefix: list[int]
    first: list[int]  # prefix + a suffix
    again: list[int]  # prefix + another suffix (the host-tier hit)
    shared: list[int]  # the batch's shared prefix
    batch: list[list[int]]
    evictors: list[list[int]]

    @classmethod
    def make(cls, seed: int = 7) -> Prompts:
        rng = random.Random(seed)
        prefix = _tokens(rng, PREFIX_TOKENS)
        shared = _tokens(rng, 160)
        return cls(
            prefix=prefix,
            first=prefix + _tokens(rng, 5),
            again=prefix + _tokens(rng, 7),
            shared=shared,
            batch=[shared + _tokens(rng, 3 + i % 5) for i in range(BATCH)],
            evictors=[_tokens(rng, PREFIX_TOKENS) for _ in range(EVICTORS)],
        )

    def fresh_evictors(self, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [_tokens(rng, PREFIX_TOKENS) for _ in range(EVICTORS)]


@dataclass
class Outcome:
    first: list[int]
    again: list[int]
    again_cached: dict
    batch: list[list[int]]
    batch_cached: list[dict]


def run(server, prompts: Prompts) -> Outcome:
    """The suite's workload on one server; outputs and what SGLang says was cached."""
    first = server.generate(prompts.first, NEW_TOKENS)
    server.generate(prompts.shared + [FIRST_WORD], NEW_TOKENS)
    for ids in prompts.evictors:
        server.generate(ids, NEW_TOKENS)
    again = server.generate(prompts.again, NEW_TOKENS)
    batch = server.generate_many(prompts.batch, NEW_TOKENS)
    return Outcome(
        first=first["output_ids"],
        again=again["output_ids"],
        again_cached=again["meta_info"].get("cached_tokens_details") or {},
        batch=[r["output_ids"] for r in batch],
        batch_cached=[r["meta_info"].get("cached_tokens_details") or {} for r in batch],
    )


def evict_and_resend(server, prompts: Prompts, seed: int) -> dict:
    """Push the prefix out of the device pool again and send it again; SGLang's response."""
    for ids in prompts.fresh_evictors(seed):
        server.generate(ids, NEW_TOKENS)
    return server.generate(prompts.again, NEW_TOKENS)
