"""Several sequences of one prompt (OpenAI's `n`, completions' `best_of`), with the prompt computed once.

The first sequence runs as any request. The others start once it has its first token: by then every full KV
block of the prompt is in the prefix cache of the workers it ran on, and they follow it there (`follow`
routing). Each finds those blocks cached and shares them (the block manager's reference counts: one copy,
held by every sequence), and computes only what no full block covers: the prompt's last, partial block and
the last token whose logits give its first token (in PD mode the same prefill worker computes that tail from
its own cache and delivers just that block). `pdserve_prompt_tokens_computed_total` counts prompt tokens run
through the model, per worker. Sequence i samples with seed `seed + i` (vLLM's rule), so a seeded request's
sequences differ and repeat.

`best_of` (completions): that many sequences run; the `n` with the highest cumulative logprob are returned
(their logprobs come back only when asked for); usage counts every generated token, as OpenAI bills them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from pdserve.core.pd.sensitivity import DEFAULT as DEFAULT_LABEL
from pdserve.core.sampling_params import SamplingParams


class Family:
    def __init__(self, gateway, prompt: list[int], params: SamplingParams, count: int, priority: int, tier: str,
                 trace: dict | None, score: bool = False, sensitivity: str = DEFAULT_LABEL) -> None:
        self.gateway, self.prompt, self.count, self.sensitivity = gateway, prompt, count, sensitivity
        self.priority, self.tier, self.trace = priority, tier, trace
        force = score and params.logprobs is None  # best_of ranks by the sampled tokens' logprobs
        self.params = [replace(params, seed=None if params.seed is None else params.seed + i,
                               logprobs=0 if force else params.logprobs) for i in range(count)]
        self.first = None
        self.flights: list = []  # every sequence's, as they start (`abort` stops them all)
        self.stopped = False  # the lead failed or the response was cut: no sibling starts
        self._prefilled = asyncio.Event()

    async def start(self) -> None:
        """Submit the first sequence (raises the conductor's refusal before any response starts)."""
        self.first = await self.gateway.start(self.prompt, self.params[0], self.priority, tier=self.tier,
                                              trace=self.trace, sensitivity=self.sensitivity)
        self.flights.append(self.first)

    async def abort(self) -> None:
        """Stop every sequence, started or not (the response was cut)."""
        self.stopped = True
        self._prefilled.set()
        for flight in list(self.flights):
            await self.gateway.conductor.abort(flight.rid)

    def streams(self) -> list[AsyncIterator]:
        return [self._lead()] + [self._follower(i) for i in range(1, self.count)]

    async def _lead(self) -> AsyncIterator:
        try:
            if self.first is None:
                await self.start()
            async for d in self.gateway.stream(self.first, self.prompt, self.params[0]):
                self._prefilled.set()
                yield d
        except BaseException:
            self.stopped = True  # (refused or failed: its error ends the response; the others need not start)
            raise
        finally:
            self._prefilled.set()  # (ended before a token: the others go ahead on their own)

    async def _follower(self, i: int) -> AsyncIterator:
        await self._prefilled.wait()
        if self.stopped:
            return
        flight = await self.gateway.start(self.prompt, self.params[i], self.priority, tier=self.tier,
                                          trace=self.trace, follow=self.first.workers if self.first else None,
                                          sensitivity=self.sensitivity)
        self.flights.append(flight)
        async for d in self.gateway.stream(flight, self.prompt, self.params[i]):
            yield d


async def merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """(index, item) from every stream as it comes; an exception in one ends all (the rest are closed)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as e:  # handed to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def best(collected: list, n: int) -> list:
    """The `n` sequences with the highest cumulative logprob, best first."""
    def score(c) -> float:
        return sum(e[0] for e in c.logprobs if e is not None)
    return sorted(collected, key=score, reverse=True)[:n]
