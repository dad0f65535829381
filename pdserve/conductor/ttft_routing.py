"""Routing by predicted time to first token, the KV transfer included (`--routing predicted-ttft`).

In PD mode the (decode, prefill) pair is chosen together, the one with the least

    TTFT(d, p) = queueing on p                 (admission's time model: `Admission.predict_prefill_s` of the
                                               prompt's tokens p does not hold behind p's backlog of the
                                               request's tier rank or better, less the same alone)
               + max(prefill on p,             (the prompt's tokens p does not hold, alone)
                     KV transfer p -> d)       (the blocks d does not hold x the bytes of one block at the pool's
                                               codec (`Ready.kv_block_bytes`) / the p -> d link's measured rate
                                               (`capacity` of p's `kv_links` stats); it streams while p computes,
                                               chunk by chunk, so the longer of the two counts)
               + d's first decode step         (d's decode batch with this request in it)

and at least the time the busier of the two workers' ports takes to carry the KV routed over it and not yet
delivered (`Books.port_bytes`), this prompt's too, at the link's rate: `link_wait_s`.

Which blocks a worker holds is what it reports (`WorkerLoad.prefix_blocks`: its `kv_cache` events). A
decode worker holding all of the prompt but its last token needs no prefill and no transfer (its
reservation says so): its TTFT is the first step alone. Ties go to fewer outstanding requests.

Fallbacks, each counted (`fallbacks{kind}`): no step-time prediction for a prefill worker yet
(`routing_unpredicted`: that role is picked by prefix affinity), a pair whose link has no measured rate yet
(`routing_link_unmeasured`: its transfer is left out). Colocated mode and single-role picks (recovery, a
follow-up) use prefix affinity. Pure: no clock, no I/O; the gateway's core and the simulator's drive it alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.conductor.routing import PrefixAffinity, WorkerLoad


@dataclass(frozen=True)
class PairEstimate:
    decode: str
    prefill: str
    queue_s: float  # on the prefill worker, before its prompt's first chunk
    prefill_s: float  # its prompt alone
    transfer_s: float
    first_step_s: float
    measured_link: bool = True
    link_wait_s: float = 0.0  # the busier port's undelivered KV and this prompt's, from now

    @property
    def ttft_s(self) -> float:
        return max(self.queue_s + max(self.prefill_s, self.transfer_s), self.link_wait_s) + self.first_step_s


@dataclass(frozen=True)
class PairRequest:
    """What the policy is asked to place: the prompt's head block hashes, its length, its tier's rank."""
    hashes: Sequence
    tokens: int
    rank: int = 0
    now: float | None = None  # the conductor's clock (how long each prefill worker's step has run)


class PredictedTtft:
    name = "predicted-ttft"

    def __init__(self, fallback: PrefixAffinity | None = None) -> None:
        self.fallback = fallback or PrefixAffinity()

    def pick(self, workers: Sequence[WorkerLoad], block_hashes: Sequence) -> WorkerLoad | None:
        return self.fallback.pick(workers, block_hashes)

    def pick_pair(self, books, req: PairRequest) -> tuple[WorkerLoad | None, WorkerLoad | None, list[str]]:
        """(decode, prefill, fallback kinds taken) for `req` over `books`' live workers (`pdserve.conductor.books`)."""
        decoders = [w for w in books.role("decode") if w.usable]
        prefills = [w for w in books.role("prefill") if w.usable]
        if not decoders:
            return None, None, []
        if not prefills:
            return self.fallback.pick(decoders, req.hashes), None, []
        estimates = self.estimates(books, req, decoders, prefills)
        if estimates is None:
            return (self.fallback.pick(decoders, req.hashes), self.fallback.pick(prefills, req.hashes),
                    ["routing_unpredicted"])
        load = {w.name: w for w in decoders + prefills}
        best = min(estimates, key=lambda e: (e.ttft_s, load[e.decode].outstanding + load[e.prefill].outstanding))
        notes = [] if best.measured_link else ["routing_link_unmeasured"]
        return load[best.decode], load[best.prefill], notes

    def estimates(self, books, req: PairRequest, decoders: Sequence[WorkerLoad],
                  prefills: Sequence[WorkerLoad]) -> list[PairEstimate] | None:
        """Every pair's prediction; None when a prefill worker's time model cannot predict yet."""
        admission, bs = books.admission, books.block_size
        if admission is None:
            return None
        timing = {}  # prefill worker -> (queueing, its prompt alone)
        for p in prefills:
            tokens = max(req.tokens - p.prefix_blocks(req.hashes) * bs, 1)
            backlog = books.backlog[p.name].tokens
            ahead = sum(n for r, n in backlog.items() if r <= req.rank)
            busy = None if req.now is None else books.backlog[p.name].busy_s(req.now)
            total = admission.predict_prefill_s(p.name, tokens, ahead, sum(backlog.values()) - ahead, 0, busy)
            alone = admission.predict_prefill_s(p.name, tokens, 0, 0)
            if total is None or alone is None:
                return None
            timing[p.name] = (max(total - alone, 0.0), alone)
        blocks = -(-req.tokens // bs)
        out = []
        for d in decoders:
            step = admission.model(d.name).decode_s(books.backlog[d.name].decoding + 1) or 0.0
            held = d.prefix_blocks(req.hashes)
            if held * bs >= req.tokens - 1:  # it has the prompt: no prefill, no transfer
                out.extend(PairEstimate(d.name, p.name, 0.0, 0.0, 0.0, step) for p in prefills)
                continue
            nbytes = (blocks - held) * books.block_bytes
            for p in prefills:
                rate = books.links.get(p.name, {}).get(d.name)
                queued = max(books.port_bytes.get(p.name, 0), books.port_bytes.get(d.name, 0))
                out.append(PairEstimate(d.name, p.name, *timing[p.name], nbytes / rate if rate else 0.0, step,
                                        bool(rate), (queued + nbytes) / rate if rate else 0.0))
        return out
