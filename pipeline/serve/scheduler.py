"""The log-prob server's async batch scheduler: pure asyncio, no HTTP.

Requests put sequences in a bounded queue; one dispatcher takes batches of them up to a
padded-token budget (waiting at most ``max_wait_s`` for a batch to fill), groups sequences of
similar length (the oldest waiting sequence is always in the next batch, so none starves),
and scores each batch in a worker thread. Pausing stops new batches and waits for the one in
flight; weight updates happen only while paused, so every batch is scored by one model whose
version the results carry.

With ``batch_invariant`` the slot scores each sequence in its own forward, and a worker call
scores the sequences that ask for prompt logprobs apart from those that do not: asking adds
rows to the output head's matmul, which moves the completion logprobs by ulps, so no
sequence's shape may depend on a neighbour's request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


class QueueFull(Exception):
    """The queue holds max_queue sequences: the client should back off (HTTP 429)."""


class Paused(Exception):
    """Paused or updating and configured to reject (HTTP 503 with Retry-After)."""


@dataclass(eq=False)  # identity: items hold arrays, and the queue finds them by identity
class Item:
    """One sequence of a request."""

    prompt: np.ndarray
    completion: np.ndarray
    want_prompt: bool
    enqueued: float
    future: asyncio.Future
    cancelled: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.completion)


@dataclass
class Stats:
    """What /metrics reports; the app reads it, the scheduler writes it."""

    batches: int = 0
    sequences: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)  # recent, for the histogram
    cancelled: int = 0


class BatchScheduler:
    """``score(pairs, want_prompt) -> (results, version info)`` runs in a worker thread on a
    batch of (prompt, completion) pairs; results come back per pair, in order."""

    def __init__(
        self,
        score: Callable,
        token_budget: int = 16384,
        max_batch: int = 64,
        max_wait_s: float = 0.005,
        max_queue: int = 4096,
        reject_when_paused: bool = False,
        batch_invariant: bool = False,
    ):
        self.score = score
        self.batch_invariant = batch_invariant
        self.token_budget = token_budget
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self.reject_when_paused = reject_when_paused
        self.pending: list[Item] = []
        self.stats = Stats()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._paused_by: set[str] = set()  # "user" (pause endpoint), "update"
        self._task: asyncio.Task | None = None

    # --- the clients' side -------------------------------------------------------------

    def submit(self, pairs: list[tuple[np.ndarray, np.ndarray, bool]]) -> list[Item]:
        """Queue a request's sequences; await ``gather(*(i.future for i in items))``."""
        if self._paused_by and self.reject_when_paused:
            raise Paused("paused" if "user" in self._paused_by else "updating weights")
        if len(self.pending) + len(pairs) > self.max_queue:
            raise QueueFull(f"the queue holds {len(self.pending)} of {self.max_queue} sequences")
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        items = [Item(p, c, w, now, loop.create_future()) for p, c, w in pairs]
        self.pending.extend(items)
        self._wake.set()
        return items

    def cancel(self, items: list[Item]) -> None:
        """The client left or timed out: its queued sequences are never scored."""
        for item in items:
            item.cancelled = True
            if not item.future.done():
                item.future.cancel()
        before = len(self.pending)
        self.pending = [i for i in self.pending if not i.cancelled]
        self.stats.cancelled += before - len(self.pending)

    @property
    def paused(self) -> bool:
        return bool(self._paused_by)

    @property
    def queue_depth(self) -> int:
        return len(self.pending)

    # --- pause / resume ------------------------------------------------------------------

    async def pause(self, who: str = "user") -> None:
        """Hold new batches; return once the batch in flight has finished."""
        self._paused_by.add(who)
        await self._idle.wait()

    def resume(self, who: str = "user") -> None:
        self._paused_by.discard(who)
        self._wake.set()

    # --- the dispatcher ------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.pending and not self._paused_by:
                await self._fill()
                if self._paused_by or not self.pending:
                    break
                try:
                    batch = self._take_batch()
                except Exception as error:  # a scheduler bug must not hang every client
                    for item in self.pending:
                        item.future.set_exception(error)
                    self.pending = []
                    continue
                await self._score(batch)

    async def _fill(self) -> None:
        """Wait up to max_wait_s from the oldest request for the batch to fill."""
        oldest = min(item.enqueued for item in self.pending)
        while self._padded_tokens(self.pending) < self.token_budget and (
            len(self.pending) < self.max_batch
        ):
            left = oldest + self.max_wait_s - time.monotonic()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    def _take_batch(self) -> list[Item]:
        """The oldest sequence and its neighbours in length, within the token budget."""
        by_length = sorted(self.pending, key=lambda item: item.length)
        oldest = min(self.pending, key=lambda item: item.enqueued)
        anchor = next(i for i, item in enumerate(by_length) if item is oldest)
        low, high = anchor, anchor + 1
        while high - low < self.max_batch:
            grow = []
            if high < len(by_length):
                grow.append(("high", by_length[high].length - by_length[anchor].length))
            if low > 0:
                grow.append(("low", by_length[anchor].length - by_length[low - 1].length))
            if not grow:
                break
            side = min(grow, key=lambda g: g[1])[0]
            trial = by_length[low : high + 1] if side == "high" else by_length[low - 1 : high]
            if self._padded_tokens(trial) > self.token_budget:
                break
            low, high = (low, high + 1) if side == "high" else (low - 1, high)
        batch = by_length[low:high]
        taken = {id(item) for item in batch}
        self.pending = [item for item in self.pending if id(item) not in taken]
        return batch

    @staticmethod
    def _padded_tokens(items: list[Item]) -> int:
        return len(items) * max((item.length for item in items), default=0)

    async def _score(self, batch: list[Item]) -> None:
        self._idle.clear()
        started = time.perf_counter()
        try:
            results, version = await asyncio.to_thread(self._score_in_thread, batch)
        except Exception as error:  # the scoring engine failed: every waiting client hears why
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(error)
        else:
            for item, result in zip(batch, results, strict=True):
                if not item.future.done():
                    item.future.set_result((result, version))
            self.stats.batches += 1
            self.stats.sequences += len(batch)
            self.stats.tokens += sum(len(item.completion) for item in batch)
            self.stats.batch_sizes = [*self.stats.batch_sizes[-999:], len(batch)]
        finally:
            self.stats.busy_s += time.perf_counter() - started
            self._idle.set()

    def _score_in_thread(self, batch: list[Item]):
        """Results in the batch's order, and the version; one slot call per prompt_logprobs
        setting in batch-invariant mode, else one call that scores prompt logprobs for every
        sequence when any asks (only the askers get them back)."""
        if not self.batch_invariant:
            pairs = [(item.prompt, item.completion) for item in batch]
            return self.score(pairs, any(item.want_prompt for item in batch))
        results: list = [None] * len(batch)
        versions = set()
        for want_prompt in (False, True):
            group = [k for k, item in enumerate(batch) if item.want_prompt == want_prompt]
            if not group:
                continue
            scored, version = self.score(
                [(batch[k].prompt, batch[k].completion) for k in group], want_prompt
            )
            versions.add(version)
            for k, result in zip(group, scored, strict=True):
                results[k] = result
        (version,) = versions  # one worker call: no update can land between the two groups
        return results, version
