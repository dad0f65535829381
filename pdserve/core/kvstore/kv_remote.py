"""What one worker knows of the shared KV pool (`--kv-remote`, a tier below its host and disk tiers that every
worker of the deployment reads and writes: Mooncake Store, `pdserve.kv.remote_store`). Pure: no I/O, no clock.

The pool's contents change under it (other workers write, the store evicts), so unlike the local tiers it keeps
no index of the pool, only what it learned: hashes it found there or wrote there (`known`, bounded, the least
recently learned forgotten first), hashes a probe found missing, and when (`absent`: asked again only after
`probe_again_s`), and hashes being probed now (a request waits for a probe at most `probe_wait_s`, then goes on
without the pool: counted in `slow_probes`). A lookup that misses locally asks the I/O runner to probe the
rest of the prefix (`probe`), then fetches the leading run it found into host (`fetch`), both off the compute
thread; a fetched block missing by then (evicted) is a miss, never an error. While the pool is down (its master
unreachable: an operation failed with `DOWN`) nothing is asked of it for `down_s`, counted each time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

DOWN = "remote_down"  # an operation's failure reason: the pool (its master) did not answer
ABSENT = "absent"  # a probed hash the pool does not hold
MAX_PROBE_BLOCKS = 512  # a probe asks about at most this many blocks of a prefix


@dataclass
class RemoteBook:
    probe_again_s: float = 1.0
    probe_wait_s: float = 0.25  # a lookup waits this long at most for the pool's answer
    down_s: float = 5.0
    max_known: int = 1 << 18
    known: OrderedDict = field(default_factory=OrderedDict)  # hash -> None, least recently learned first
    absent: dict = field(default_factory=dict)  # hash -> when a probe found it missing
    probing: dict = field(default_factory=dict)  # hash -> when its probe was asked
    bad: set = field(default_factory=set)  # hashes whose value in the pool was found damaged here
    written: list = field(default_factory=list)  # hashes this worker wrote there since `take_written`
    down_until_s: float = float("-inf")
    downs: int = 0  # times the pool was found down
    slow_probes: int = 0  # lookups that stopped waiting for a probe's answer

    def up(self, now: float) -> bool:
        return now >= self.down_until_s

    def leading(self, hashes: Sequence[int]) -> int:
        """How many leading `hashes` the pool is known to hold (in a value not found damaged here)."""
        n = 0
        for h in hashes:
            if h not in self.known or h in self.bad:
                break
            n += 1
        return n

    def to_probe(self, hashes: Sequence[int], now: float) -> tuple[list[int], bool]:
        """The hashes of `hashes` (the rest of a prefix after what is known) worth asking the pool about now, and
        whether an answer about them is on its way (a probe under way: wait for it)."""
        if not self.up(now) or not len(hashes):
            return [], False
        first = hashes[0]
        seen = self.absent.get(first)
        if first in self.bad or (seen is not None and now - seen < self.probe_again_s):
            return [], False
        asked = self.probing.get(first)
        if asked is not None:
            if now - asked < self.probe_wait_s:
                return [], True
            self.slow_probes += 1  # (once per probe: its prefix now counts as absent for `probe_again_s`)
            self.absent[first] = now
            return [], False
        ask = [h for h in hashes[:MAX_PROBE_BLOCKS] if h not in self.probing]
        self.probing.update(dict.fromkeys(ask, now))
        return ask, False

    def probed(self, h: int, failed: str | None, now: float) -> None:
        self.probing.pop(h, None)
        if failed is None:
            self.learn(h)
        elif failed == ABSENT:
            self.absent[h] = now
            self.known.pop(h, None)
        elif failed == DOWN:
            self.down(now)

    def learn(self, h: int, written: bool = False) -> None:
        """The pool holds `h` (found there, or `written` there by this worker: a damaged value replaced)."""
        self.absent.pop(h, None)
        if written:
            self.bad.discard(h)
            if len(self.written) < self.max_known:
                self.written.append(h)
        self.known[h] = None
        self.known.move_to_end(h)
        if len(self.known) > self.max_known:
            self.known.popitem(last=False)

    def take_written(self) -> list[int]:
        """The hashes this worker wrote to the pool since the last call (its `kv_cache` report's `remote` part:
        routing counts the pool as a tier every worker reaches, `pdserve.conductor.routing`)."""
        out, self.written = self.written, []
        return out

    def forget(self, h: int) -> None:
        """`h` was not (or no longer) in the pool when read: evicted there."""
        self.known.pop(h, None)

    def refuse(self, h: int) -> None:
        """`h`'s value in the pool was damaged: never read again here (until this worker writes it afresh)."""
        self.known.pop(h, None)
        self.bad.add(h)
        if len(self.bad) > self.max_known:
            self.bad.pop()

    def down(self, now: float) -> None:
        if self.up(now):
            self.downs += 1
        self.down_until_s = now + self.down_s

    def sweep(self, now: float) -> None:
        """Forget misses older than `probe_again_s` (they would be asked again anyway)."""
        if len(self.absent) > 4096:
            self.absent = {h: t for h, t in self.absent.items() if now - t < self.probe_again_s}
