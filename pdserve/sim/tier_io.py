"""`SimTierIO`: the simulator's KV tier I/O runner, on simulated time.

It implements the contract `pdserve.engine.llm_engine.LLMEngine` expects of `executor.kv_io` (as
`pdserve.kv.tier_io.TierIO` does for the real worker): `capacity`, `restored()`, `submit(ops)`, `poll()`,
`load(loads)`. The tier bookkeeping itself (what is copied where, hits, eviction, lifecycle) is the real
`pdserve.core.kvstore.kv_tiers.TieredKV`, driven by the real engine; this module only decides when each operation
ends. No bytes move and nothing fails.

Links (each a FIFO queue: an operation starts when the one before it on its link has ended):
* `host_link` (GPU -> host, PCIe): offloads, each `len(hashes) x block_bytes` at `host_link_bw`;
* `disk_write`: flushes (host -> disk) at `disk_write_bw`;
* `disk_read`: prefetches (disk -> host) at `disk_read_bw`;
* deletes of disk files take no time;
* with a shared pool (`pdserve.sim.kv_pool.SimKVPool`, one for the whole cluster): `remote_read` (the real
  runner's lookup thread: probes, a round trip each, and fetches, pool -> host, a round trip plus the blocks at
  the pool link's bandwidth) and `remote_write` (its publish thread: host -> pool, the same). The pool answers a
  probe or a fetch as of the operation's end and holds a published block from its end on.
Loads (host -> device, the other direction of PCIe) are synchronous in the real executor, before the step's
forward: `load` returns their time and the `SimExecutor` adds it to the step.

Submitted operations wait for `start(at_s)`: those `LLMEngine.poll_kv` submits (flushes of finished copies,
prefetches a lookup started) start right away (the `SimExecutor` starts them before the forward, the
`SimEngine` after its own poll at a step boundary); those a step produces after its forward start when that
step ends (the `SimEngine` calls `start(step_end_s)` after each `LLMEngine.step()`). `poll()` returns the
operations whose end is at or before the engine's clock.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pdserve.core.kvstore import kv_codecs
from pdserve.core.kvstore.kv_ops import KVLoad, KVOp, TierCapacity
from pdserve.sim.kv_pool import SimKVPool

GIB = 2**30  # tier sizes are in GiB, as the real worker's --kv-host-gb and --kv-disk-gb
LINKS = ("host_link", "disk_read", "disk_write", "remote_read", "remote_write")
LINK_OF = {"offload": "host_link", "flush": "disk_write", "prefetch": "disk_read",  # delete: no link
           "probe": "remote_read", "fetch": "remote_read", "publish": "remote_write"}
REMOTE_LINKS = ("remote_read", "remote_write")


@dataclass(frozen=True)
class TierSpec:
    """One engine's lower tiers: capacities in blocks and the bandwidths (bytes/s) of its links."""

    host_blocks: int
    disk_blocks: int
    block_bytes: int  # a block in the host tier's codec (what the host link carries)
    host_link_bw: float
    disk_read_bw: float
    disk_write_bw: float
    disk_block_bytes: int | None = None  # a block in the disk tier's codec; None: block_bytes
    codecs: tuple[str, str] | None = None  # the host and disk tiers' codec names (None: the pool's)

    def link_bytes(self, link: str) -> int:
        """Bytes of one block on `link` (the disk's links carry the disk tier's codec)."""
        return self.block_bytes if link == "host_link" or self.disk_block_bytes is None else self.disk_block_bytes

    @property
    def capacity(self) -> TierCapacity:
        return TierCapacity(self.host_blocks, self.disk_blocks, self.block_bytes, *(self.codecs or (None, None)))


def tier_spec(host_gb: float, disk_gb: float, block_bytes: int, host_link_bw: float, disk_read_bw: float,
              disk_write_bw: float, disk_block_bytes: int | None = None,
              codecs: tuple[str, str] | None = None) -> TierSpec | None:
    """Tiers sized as the real worker sizes them (`pdserve.kv.tier_io.build_tier_io`): host slots of one
    block each (`block_bytes`, in the host tier's codec), disk files of one block (`disk_block_bytes`, in the
    disk tier's; default the host's) plus the file header; None without a host tier."""
    if not host_gb:
        return None
    from pdserve.kv.disk_store import HEADER  # the real file format's header (pure Python, no torch)
    disk_bytes = block_bytes if disk_block_bytes is None else disk_block_bytes
    host_blocks = kv_codecs.tier_blocks(host_gb, block_bytes)
    disk_blocks = kv_codecs.tier_blocks(disk_gb, disk_bytes + HEADER.size) if disk_gb else 0
    return TierSpec(host_blocks, disk_blocks, block_bytes, host_link_bw, disk_read_bw, disk_write_bw, disk_bytes,
                    codecs)


class SimTierIO:
    def __init__(self, spec: TierSpec, clock: Callable[[], float], pool: SimKVPool | None = None) -> None:
        self.spec = spec
        self.pool = pool  # the cluster's shared pool (None: none)
        self.capacity = replace(spec.capacity, remote=pool is not None)
        self.clock = clock
        self._bw = {"host_link": spec.host_link_bw, "disk_read": spec.disk_read_bw,
                    "disk_write": spec.disk_write_bw, **dict.fromkeys(REMOTE_LINKS, pool.bw if pool else 0.0)}
        self._free_at = dict.fromkeys(LINKS, 0.0)  # when each link's queue empties
        self._unstarted: list[KVOp] = []
        self._in_flight: list[tuple[float, int]] = []  # heap of (end, op id)
        self._failures: dict[int, dict[int, str]] = {}  # op id -> its failures (a probe's absent hashes, ...)
        self.ops: Counter = Counter()  # by kind
        self.bytes: Counter = Counter()  # by link
        self.busy_s: Counter = Counter()  # by link: seconds transferring
        self.queued_s: Counter = Counter()  # by link: seconds operations waited for the link
        self.load_s = 0.0  # host -> device, inside steps
        self.loaded_blocks = 0

    # ---- the kv_io contract -----------------------------------------------------------------------------
    def restored(self) -> list[tuple[int, float, float]]:
        return []  # a simulated disk starts empty

    def submit(self, ops: Sequence[KVOp]) -> None:
        self._unstarted.extend(ops)

    def poll(self) -> list[tuple[int, dict[int, str]]]:
        now, heap, out = self.clock(), self._in_flight, []
        while heap and heap[0][0] <= now:
            op_id = heapq.heappop(heap)[1]
            out.append((op_id, self._failures.pop(op_id, {})))
        return out

    def load(self, loads: Sequence[KVLoad]) -> float:
        """Seconds the step spends copying `loads` host -> device before its forward."""
        if not loads:
            return 0.0
        seconds = len(loads) * self.spec.block_bytes / self.spec.host_link_bw
        self.load_s += seconds
        self.loaded_blocks += len(loads)
        return seconds

    # ---- simulated time -----------------------------------------------------------------------------------
    def start(self, at_s: float) -> None:
        """The operations submitted so far begin at `at_s` (or when their link is free), in submission order."""
        ops, self._unstarted = self._unstarted, []
        for op in ops:
            self.ops[op.kind] += 1
            link = LINK_OF.get(op.kind)
            end = at_s
            if link is not None:
                nbytes = self._op_bytes(op, link)
                begin = max(at_s, self._free_at[link])
                end = begin + nbytes / self._bw[link] + (self.pool.rtt_s if link in REMOTE_LINKS else 0.0)
                self._free_at[link] = end
                self.bytes[link] += nbytes
                self.busy_s[link] += end - begin
                self.queued_s[link] += begin - at_s
                if link in REMOTE_LINKS:
                    self._pool_op(op, end)
            heapq.heappush(self._in_flight, (end, op.op_id))

    def _op_bytes(self, op: KVOp, link: str) -> int:
        if link not in REMOTE_LINKS:
            return len(op.hashes) * self.spec.link_bytes(link)
        return 0 if op.kind == "probe" else len(op.hashes) * self.pool.block_bytes

    def _pool_op(self, op: KVOp, end_s: float) -> None:
        """The pool's answer to `op` (ending at `end_s`), kept for the poll that reports its end."""
        if op.kind == "publish":
            self.pool.publish(op.hashes, end_s)
            return
        failures = (self.pool.probe if op.kind == "probe" else self.pool.fetch)(op.hashes, end_s)
        if failures:
            self._failures[op.op_id] = failures

    def due(self, t: float) -> bool:
        """Whether a poll at `t` finds an operation done, or a start at `t` has one to begin."""
        return self.next_due_s() <= t

    def next_due_s(self) -> float:
        """From when `due` holds if nothing else changes: -inf at once, inf never."""
        if self._unstarted:
            return -math.inf
        return self._in_flight[0][0] if self._in_flight else math.inf

    def next_done_s(self) -> float | None:
        """When the next operation in flight ends (None when none is)."""
        return self._in_flight[0][0] if self._in_flight else None

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight) + len(self._unstarted)

    def stats(self, duration_s: float) -> dict:
        return {"bandwidth": dict(self._bw), "ops": dict(self.ops), "bytes": {k: self.bytes[k] for k in LINKS},
                "busy_s": {k: self.busy_s[k] for k in LINKS},
                "utilization": {k: self.busy_s[k] / duration_s if duration_s > 0 else 0.0 for k in LINKS},
                "queued_s": {k: self.queued_s[k] for k in LINKS},
                "load_s": self.load_s, "loaded_blocks": self.loaded_blocks}
