"""A batch's back-off when the server throttles it (503 SlowDown, 429): one pause for all its requests.

The first throttled answer of an episode asks the server how long to wait (``Retry-After``: obstore's
errors carry no response headers, so a ``HEAD`` of the same object reads it, counted as a request),
and no request of the batch starts before then; without ``Retry-After`` the pause grows exponentially
from :data:`BASE_S`. Each retry waits a random spread past the pause (jitter) so the batch's retries do
not land as one burst. A batch adds at most ``budget`` requests in all (retries and the ``Retry-After``
asks); past that, or past the batch's deadline, a throttled request fails with :class:`Throttled`.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Awaitable, Callable

from hicache_core.storage.backend import StorageError

#: Requests a batch may add in all when throttled (its retries and Retry-After asks), by default.
THROTTLE_RETRIES = 8
#: The first pause without a Retry-After, doubled each episode up to the request timeout.
BASE_S = 0.2
#: What a throttling answer says (S3's SlowDown, HTTP 429 and 503, other stores' words).
_WORDS = ("slowdown", "toomanyrequests", "requestlimitexceeded", "throttl", "429 too many requests",
          "status: 429", "503 service unavailable", "status: 503", "reduce your request rate")  # fmt: skip


class Throttled(StorageError):
    """The server throttled a request (503 SlowDown, 429) past the batch's budget of retries or its deadline."""


def is_throttled(text: str) -> bool:
    """Whether an error's text is a throttling answer."""
    low = text.lower()
    return any(w in low for w in _WORDS)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta seconds or an HTTP date); ``None`` when absent or malformed."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Throttle:
    """One batch's shared back-off state; every request of the batch goes through :meth:`admit`.

    :param budget: requests the batch may add in all (retries and ``Retry-After`` asks).
    :param deadline: the loop time past which no retry starts.
    :param cap_s: the longest pause the batch waits without a ``Retry-After``.
    :param ask: a coroutine function that asks the server for ``Retry-After`` (a request), or ``None``.
    """

    def __init__(
        self,
        budget: int,
        deadline: float,
        cap_s: float,
        ask: Callable[[str], Awaitable[float | None]] | None,
        rng: random.Random | None = None,
    ) -> None:
        self.left = budget
        self.budget = budget
        self.deadline = deadline
        self.cap_s = cap_s
        self.ask = ask
        self.rng = rng or random.Random()
        self.resume_at = 0.0
        self.episodes = 0
        self.throttled = 0
        self.asked: float | None = None
        self._lock = asyncio.Lock()

    async def admit(self) -> None:
        """Wait until the batch's pause, if any, is over."""
        loop = asyncio.get_running_loop()
        while (wait := self.resume_at - loop.time()) > 0:
            await asyncio.sleep(wait)

    async def retry_after_throttled(self, path: str) -> bool:
        """A request of ``path`` was throttled: wait as the server asks and return True, or False to give up."""
        loop = asyncio.get_running_loop()
        self.throttled += 1
        async with self._lock:
            if loop.time() >= self.resume_at and self.left > 0:  # a new episode: this request leads it
                asked = None
                if self.ask is not None:
                    self.left -= 1
                    asked = await self.ask(path)
                    self.asked = asked if asked is not None else self.asked
                grown = min(self.cap_s, BASE_S * 2**self.episodes)
                pause = max(asked or 0.0, self.rng.uniform(grown / 2, grown))
                self.episodes += 1
                self.resume_at = loop.time() + pause
            if self.left <= 0:
                return False
            pause = max(0.0, self.resume_at - loop.time())
            at = self.resume_at + self.rng.uniform(0, 0.1 * pause + 0.01)  # spread: not one burst
            if at >= self.deadline:
                return False
            self.left -= 1
        await asyncio.sleep(max(0.0, at - loop.time()))
        return True

    def reason(self) -> str:
        """Why a throttled request gave up, for its error."""
        asked = f"; the server asked to wait {self.asked:g} s" if self.asked is not None else ""
        if self.left <= 0:
            return (f"gave up after the batch's {self.budget} extra requests (throttle_retries={self.budget}){asked}; "
                    "lower concurrency= or spread the load over more prefixes")  # fmt: skip
        return f"the batch's deadline came before the server's pause ended{asked}"
