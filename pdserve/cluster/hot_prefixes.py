"""Hot prompt prefixes, and which one an idle prefill worker computes ahead (idle prewarm).

Prefix-affine routing sends the requests that share a prefix (a system prompt, a shared document, a long
conversation) to the prefill worker that saw it last, so a hot prefix can keep one prefill worker busy while
another sits idle with nothing cached. In PD mode the conductor core counts, for each prompt it routes, the
requests that shared each of its leading blocks (chained block hashes: block k stands for the whole prefix up
to k), a count that halves every `HALF_LIFE_S`. A prefix is hot from `HOT_COUNT` (two requests within a
half-life) and is forgotten once its count has fallen below half that; a block hash's count is dropped once it
has decayed below `FORGET_COUNT`.

When a prefill worker is idle (nothing routed to it waiting, no stage pass), the core asks `pick` for the
hot prefix it lacks (by its remembered prefixes, `WorkerLoad.prefix_blocks`) that is worth the most (decayed
count x blocks it would add) and fits its staging room, and sends it a `warm` command: a stage pass of just
those tokens (`pdserve.core.stage_passes`), ranked after every real prefill, whose KV stays in that worker's
prefix cache and host tier. Once it is done the worker remembers the prefix, so routing can spread the
prefix's requests over both workers. Counted: `Count("kv_idle_prewarms", worker, outcome)`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.cluster.routing import HashRun

HOT_COUNT = 1.5  # decayed count of requests that makes a prefix hot: two within a half-life
HALF_LIFE_S = 60.0
MIN_BLOCKS = 2  # shorter prefixes are not worth a pass
MAX_TRACKED = 1 << 16  # block hashes counted (least recently seen dropped first)
FORGET_COUNT = 1 / 16  # a hash whose count decayed below this is dropped (a single request: after 4 half-lives)
MAX_HOT = 64  # hot prefixes kept as candidates (the least valuable dropped first)


@dataclass
class HotPrefix:
    tokens: list
    hashes: tuple
    count: float  # requests that shared it, decayed to `at_s`
    at_s: float

    def count_at(self, now: float) -> float:
        return self.count * 0.5 ** (max(now - self.at_s, 0.0) / HALF_LIFE_S)


class HotPrefixes:
    def __init__(self) -> None:
        self._counts: OrderedDict = OrderedDict()  # block hash -> [decayed count, at_s]
        self.hot: dict[int, HotPrefix] = {}  # its last block's hash -> prefix
        self.warming: dict[str, tuple[str, HotPrefix]] = {}  # warm pass id -> (prefill worker, prefix)
        self._version = 0  # bumped when a prefix turns hot or deepens: idle workers look again
        self._looked: dict[str, int] = {}  # prefill worker -> the version it found nothing to warm at

    def observe(self, hashes: Sequence, prompt: Sequence[int], block_size: int, now: float) -> None:
        """A prompt was routed: count the requests sharing each of its leading blocks (`hashes`)."""
        deepest, count = 0, 0.0
        counts = self._counts
        for k, h in enumerate(hashes):
            entry = counts.get(h)
            if entry is None:
                rest = hashes[k:]
                if not any(h in counts for h in rest):  # (the usual case: a prefix seen once, the rest new)
                    counts.update((h, [1.0, now]) for h in rest)  # below HOT_COUNT: none is hot yet
                    break
                entry = counts[h] = [0.0, now]
            else:
                counts.move_to_end(h)
            entry[0] = entry[0] * 0.5 ** (max(now - entry[1], 0.0) / HALF_LIFE_S) + 1.0
            entry[1] = now
            if entry[0] >= HOT_COUNT:
                deepest, count = k + 1, entry[0]
        while len(counts) > MAX_TRACKED:
            counts.popitem(last=False)
        self._forget(now)
        if deepest >= MIN_BLOCKS:
            self._remember(hashes[deepest - 1], HotPrefix(list(prompt[:deepest * block_size]),
                                                          HashRun(hashes[:deepest]), count, now))

    def _forget(self, now: float) -> None:
        """Drop the least recently seen hashes whose count has decayed to nothing: under steady load the table
        holds the last few half-lives' prompts, not all it has seen up to `MAX_TRACKED`."""
        counts = self._counts
        while counts:
            count, at_s = next(iter(counts.values()))
            if count * 0.5 ** (max(now - at_s, 0.0) / HALF_LIFE_S) >= FORGET_COUNT:
                return
            counts.popitem(last=False)

    def _remember(self, key, prefix: HotPrefix) -> None:
        if key not in self.hot:
            self._version += 1
        self.hot[key] = prefix
        if len(self.hot) > MAX_HOT:
            del self.hot[min(self.hot, key=lambda k: self._value(self.hot[k], prefix.at_s))]

    @staticmethod
    def _value(p: HotPrefix, now: float, have: int = 0) -> float:
        return p.count_at(now) * (len(p.hashes) - have)

    def pick(self, worker, max_blocks: int, now: float) -> HotPrefix | None:
        """The hot prefix `worker` (a `WorkerLoad`) should compute now, or None (nothing new since it last
        found nothing)."""
        if self._looked.get(worker.name) == self._version:
            return None
        best, best_value = None, 0.0
        for key, p in list(self.hot.items()):
            if p.count_at(now) < HOT_COUNT / 2:
                del self.hot[key]  # cooled down
                continue
            have = worker.prefix_blocks(p.hashes)
            if len(p.hashes) > max_blocks or have >= len(p.hashes):
                continue
            value = self._value(p, now, have)
            if value > best_value:
                best, best_value = p, value
        if best is None:
            self._looked[worker.name] = self._version
        return best

    def start(self, rid: str, worker: str, prefix: HotPrefix) -> None:
        self.warming[rid] = (worker, prefix)

    def end(self, rid: str) -> tuple[str, HotPrefix] | None:
        """The warm pass `rid` ended (or its worker died): (its worker, its prefix)."""
        return self.warming.pop(rid, None)

    def worker_gone(self, name: str) -> list[str]:
        """`name` died: its warm passes (ended) and what it was found to lack (it starts over empty)."""
        self._looked.pop(name, None)
        ended = [rid for rid, (w, _) in self.warming.items() if w == name]
        for rid in ended:
            del self.warming[rid]
        return ended
