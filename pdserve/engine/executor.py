"""Executors: what runs a scheduled step. The engine sees only the `Executor` protocol."""

from __future__ import annotations

from typing import Protocol

import xxhash

from pdserve.core.sched.schedule import ExecutorOutput, SchedulerOutput
from pdserve.core.settings import KvBlockSettings, default_of


class Executor(Protocol):
    block_size: int
    vocab_size: int

    def execute(self, scheduled: SchedulerOutput) -> ExecutorOutput:
        """Compute every chunk's KV into its blocks and sample a token for each chunk with `sample`."""
        ...


class FakeExecutor:
    """A model-free executor for tests and the simulator seam, with a real contract.

    Its "KV cache" stores, per slot, the (position, token) written there. Each chunk writes its tokens
    into the slots its block table names, then reads the whole context back through the block table: a
    prefix hit on a wrong block, a skipped position or a stale slot raises instead of passing silently.
    The sampled token is a hash of the context read back, so the same request yields the same tokens
    however it was batched, chunked, preempted or served from the prefix cache.
    """

    def __init__(self, block_size: int = default_of(KvBlockSettings, "block_size"), vocab_size: int = 1000) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.steps: list[SchedulerOutput] = []
        self._slots: dict[int, tuple[int, int]] = {}

    def execute(self, scheduled: SchedulerOutput) -> ExecutorOutput:
        self.steps.append(scheduled)
        sampled = {}
        for chunk in scheduled.chunks:
            for i, token in enumerate(chunk.token_ids):
                pos = chunk.start_pos + i
                self._slots[self._slot(chunk, pos)] = (pos, token)
            if chunk.sample:
                end = chunk.start_pos + chunk.num_tokens
                sampled[chunk.request_id] = self.next_token(self._read(chunk, end))
        return ExecutorOutput(sampled)

    def _slot(self, chunk, pos: int) -> int:
        return chunk.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def _read(self, chunk, end: int) -> list[int]:
        context = []
        for pos in range(end):
            stored = self._slots.get(self._slot(chunk, pos))
            if stored is None or stored[0] != pos:
                raise AssertionError(f"{chunk.request_id}: KV for position {pos} missing or stale: {stored}")
            context.append(stored[1])
        return context

    def next_token(self, context: list[int]) -> int:
        return xxhash.xxh64_intdigest(repr(context).encode()) % self.vocab_size
