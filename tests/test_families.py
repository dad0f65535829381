"""A request's sequences (n > 1, best_of) live and end together: `pdserve.server.families.Family` and the
non-streaming collector, driven through a fake gateway at the gateway seam (its start / stream / abort)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.server import api
from pdserve.server.families import Family
from pdserve.server.gateway import Delta, WorkerError


class FakeGateway:
    """Starts flights (refusing the ones named in `refuse`), streams `length` tokens per flight, records
    aborts; a flight's stream ends when it is aborted, as the real conductor ends it."""

    def __init__(self, refuse=(), length: int = 40) -> None:
        self.refuse, self.length = set(refuse), length
        self.started: list[str] = []
        self.aborted: list[str] = []
        self.tokens: dict[str, int] = {}
        self.conductor = SimpleNamespace(abort=self._abort)

    async def start(self, prompt, params, priority=0, pin=None, tier="default", trace=None, follow=None,
                    sensitivity="internal"):
        rid = f"seq{len(self.started)}"
        self.started.append(rid)
        if rid in self.refuse:
            raise WorkerError({"status": 429, "message": "queue full", "code": "server_overloaded"})
        return SimpleNamespace(rid=rid, workers=["decode-0"])

    async def stream(self, flight, prompt, params):
        for i in range(self.length):
            if flight.rid in self.aborted:
                return
            await asyncio.sleep(0.005)
            self.tokens[flight.rid] = i + 1
            yield Delta("x", i + 1, i + 1 == self.length, "length" if i + 1 == self.length else None, 0, 7)

    async def _abort(self, rid: str) -> None:
        self.aborted.append(rid)


class Connected:
    async def is_disconnected(self) -> bool:
        return False


def _family(gateway, count=3) -> Family:
    return Family(gateway, [1, 2, 3], SamplingParams(max_tokens=40), count, 0, "default", None)


def _others() -> list:
    return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


def test_all_sequences_run_to_the_end():
    async def main():
        gw = FakeGateway()
        results = await api._collect_all(Connected(), [_family(gw)])
        assert [r.num_tokens for r in results[0]] == [40, 40, 40] and gw.started == ["seq0", "seq1", "seq2"]
    asyncio.run(main())


def test_a_refused_first_sequence_starts_no_sibling_and_leaves_no_task():
    async def main():
        gw = FakeGateway(refuse={"seq0"})
        with pytest.raises(WorkerError):
            await asyncio.wait_for(api._collect_all(Connected(), [_family(gw)]), 5)
        await asyncio.sleep(0.05)
        assert gw.started == ["seq0"] and _others() == []
    asyncio.run(main())


def test_a_refused_sibling_ends_the_others_at_once():
    async def main():
        gw = FakeGateway(refuse={"seq2"})
        with pytest.raises(WorkerError):
            await asyncio.wait_for(api._collect_all(Connected(), [_family(gw)]), 5)
        made = dict(gw.tokens)
        await asyncio.sleep(0.1)
        assert gw.tokens == made and made["seq0"] < 40 and _others() == []  # nothing runs on after the error
    asyncio.run(main())


def test_abort_stops_every_started_sequence_and_starts_no_more():
    async def main():
        gw = FakeGateway()
        family = _family(gw)
        await family.start()
        lead, *followers = family.streams()
        first = await lead.__anext__()
        assert first.num_tokens == 1
        await family.abort()
        assert gw.aborted == ["seq0"]
        assert [d async for d in followers[0]] == [] and gw.started == ["seq0"]  # (cut before it started)
        await lead.aclose()
    asyncio.run(main())
