"""How each prefix is reused, learnt from its history, and when it is expected back (think time).

A worker sees each turn of a conversation as a request whose prompt continues an earlier turn's sequence.
When a request ends here (its last use of its blocks), its prefix is recorded under the hashes of its last full
prompt block, of its last full block and of every KEY_STRIDE-th block (`ended`: a later turn may share all
but the previous prompt's tail, as when its last block was partial). When a request arrives, the deepest
recorded hash in its prompt's chain is the turn it continues (`arrived`): the gap from that turn's end to this
arrival is a think time, kept for that conversation (the next turn's record inherits the gaps) and for everyone
(the prior).

Patterns (`kv_meta.Pattern`), per record:
* RECURRING - continued by a later turn whose prompt extends it (a conversation);
* PERIODIC  - the same prompt asked again at least PERIODIC_MIN times, at intervals of small spread
  (coefficient of variation at most PERIODIC_CV);
* ONE_OFF   - its expected reuse did not come by `late_s` (`lapsed`);
* UNKNOWN   - seen once, too early to say.

`ended` returns an `Expectation`: when the prefix is expected back (`expected_s`: end + the median of its own
think times, else of everyone's once the prior holds PRIOR_MIN), from when it is likely (`early_s`: the lower
quartile) and how uncertain that is (`spread_s`: the interquartile range of its own think times once it has
SPREAD_MIN, else of everyone's), after when it counts as lapsed
(`late_s`), and how likely it comes back at all (`reuse_p`: the
share of its pattern's earlier expectations that were met, learnt as they are met or lapse). A prefix with no
think time of its own and no prior is given no expected use. The stage-driven placement
(`pdserve.core.kvstore.kv_placement`) acts on these.
Records are bounded (MAX_RECORDS, least recently ended dropped, counted). Pure bookkeeping: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.core.kvstore.kv_meta import Pattern

GAP_SAMPLES = 16  # think times kept per conversation
PRIOR_SAMPLES = 256  # think times kept over all prefixes (the prior)
PRIOR_MIN = 8  # the prior is used once it holds this many
SPREAD_MIN = 3  # a conversation's own think times say how uncertain its next one is once it has this many
PERIODIC_MIN = 2  # repeats of one prompt before it can be periodic
PERIODIC_CV = 0.5
MAX_RECORDS = 8192
KEY_STRIDE = 32  # a record is also found from every KEY_STRIDE-th block of its prompt


@dataclass
class PrefixRecord:
    hashes: np.ndarray  # the ended request's full blocks (uint64), in sequence order
    ended_s: float
    gaps: deque = field(default_factory=lambda: deque(maxlen=GAP_SAMPLES))  # its conversation's think times
    extended: int = 0  # later prompts that extended it (turns)
    repeats: int = 0  # later prompts that were it again
    reused_s: float | None = None  # the last arrival that continued it
    pattern: Pattern = Pattern.UNKNOWN
    keys: list = field(default_factory=list)  # the hashes it is recorded under
    ended_as: Pattern = Pattern.UNKNOWN  # its pattern when it ended (whose reuse share its outcome counts in)
    num_prompt: int = 0  # its prompt's full blocks


@dataclass(frozen=True)
class Expectation:
    """A prefix's next use, as `ended` predicts it (`expected_s`/`early_s` None: no prediction)."""
    key: int
    hashes: np.ndarray
    ended_s: float
    expected_s: float | None
    early_s: float | None
    late_s: float | None
    pattern: Pattern
    reuse_p: float
    spread_s: float = math.inf


class PrefixPatterns:
    def __init__(self, max_records: int = MAX_RECORDS) -> None:
        self.max_records = max_records
        self._records: dict[int, PrefixRecord] = {}  # key hash -> record
        self._ended: OrderedDict[int, PrefixRecord] = OrderedDict()  # id -> record, oldest end first
        self._parent: dict[str, PrefixRecord] = {}  # live request -> the record it continues
        self.prior: deque = deque(maxlen=PRIOR_SAMPLES)
        self.counts: Counter = Counter()  # continued, repeated, lapsed, dropped
        self.outcomes: Counter = Counter()  # (pattern it ended as, met | lapsed) -> expectations

    def __len__(self) -> int:
        return len(self._ended)

    def record(self, key: int) -> PrefixRecord | None:
        return self._records.get(key)

    def arrived(self, request_id: str, prompt_hashes: Sequence[int], now: float) -> PrefixRecord | None:
        """A request arrived with these full prompt blocks: the record it continues (deepest first), if any;
        the gap since that record's end is learnt as a think time."""
        records = self._records
        for depth in range(len(prompt_hashes), 0, -1):
            rec = records.get(prompt_hashes[depth - 1])
            if rec is not None:
                break
        else:
            return None
        if 2 * depth < rec.num_prompt:  # a prefix many prompts share (a system prompt), not this turn's
            return None
        gap = now - rec.ended_s
        if gap >= 0:
            rec.gaps.append(gap)
            self.prior.append(gap)
        if rec.reused_s is None or rec.reused_s < rec.ended_s:  # the first reuse since it ended
            self.outcomes[(rec.ended_as, "met")] += 1
        if depth == len(prompt_hashes) == rec.num_prompt:
            rec.repeats += 1
            self.counts["repeated"] += 1
        else:
            rec.extended += 1
            self.counts["continued"] += 1
        rec.reused_s = now
        rec.pattern = _pattern(rec)
        self._parent[request_id] = rec
        return rec

    def ended(self, request_id: str, hashes: Sequence[int], num_prompt_blocks: int, now: float
              ) -> Expectation | None:
        """The request's use of its blocks (`hashes`: its full blocks; the first `num_prompt_blocks` its
        prompt's) ended now: its prefix is recorded; returns when it is expected back."""
        parent = self._parent.pop(request_id, None)
        if not len(hashes):
            return None
        rec = PrefixRecord(np.asarray(hashes, np.uint64), now)
        if parent is not None:
            rec.gaps.extend(parent.gaps)
            rec.extended, rec.repeats = parent.extended, parent.repeats
            rec.pattern = parent.pattern
            self._forget(parent)  # the conversation moved on: its newest turn stands for it
        last = min(num_prompt_blocks, len(hashes))
        keys = dict.fromkeys([int(hashes[last - 1])] if last > 0 else [])  # (the prompt's end first)
        keys.update(dict.fromkeys([int(hashes[-1])] + [int(h) for h in hashes[KEY_STRIDE - 1:last:KEY_STRIDE]]))
        rec.ended_as, rec.num_prompt = rec.pattern, last
        for key in keys:
            old = self._records.pop(key, None)
            if old is not None:  # the key is the newer record's (a prefix both share)
                old.keys.remove(key)
                if not old.keys:
                    self._ended.pop(id(old), None)
            self._records[key] = rec
            rec.keys.append(key)
        self._ended[id(rec)] = rec
        while len(self._ended) > self.max_records:
            self._forget(next(iter(self._ended.values())))
            self.counts["dropped"] += 1
        return self._expect(int(hashes[-1]), rec)

    def forget(self, request_id: str) -> None:
        """The request ended without using its blocks to the end (aborted, failed): no record."""
        self._parent.pop(request_id, None)

    def lapsed(self, key: int, ended_s: float) -> PrefixRecord | None:
        """The expectation made when the record under `key` ended at `ended_s` passed its `late_s`: if nothing
        continued it since, it is ONE_OFF (returned); else None."""
        rec = self._records.get(key)
        if rec is None or rec.ended_s != ended_s or (rec.reused_s is not None and rec.reused_s >= ended_s):
            return None
        self.outcomes[(rec.ended_as, "lapsed")] += 1
        rec.pattern = Pattern.ONE_OFF
        self.counts["lapsed"] += 1
        return rec

    def reuse_p(self, pattern: Pattern) -> float:
        """The share of expectations made for prefixes ending as `pattern` that were met (Laplace-smoothed)."""
        met, lapsed = self.outcomes[(pattern, "met")], self.outcomes[(pattern, "lapsed")]
        return (met + 1) / (met + lapsed + 2)

    def _forget(self, rec: PrefixRecord) -> None:
        for key in rec.keys:
            if self._records.get(key) is rec:
                del self._records[key]
        self._ended.pop(id(rec), None)

    def _expect(self, key: int, rec: PrefixRecord) -> Expectation:
        gaps = rec.gaps if rec.gaps else (self.prior if len(self.prior) >= PRIOR_MIN else ())
        p = self.reuse_p(rec.pattern)
        if not len(gaps):
            return Expectation(key, rec.hashes, rec.ended_s, None, None, None, rec.pattern, p)
        late_gaps = self.prior if len(self.prior) >= PRIOR_MIN else gaps
        g = np.fromiter(gaps, float)
        early, think = (float(x) for x in np.percentile(g, [25, 50]))
        late = max(2.0 * think, float(np.percentile(np.fromiter(late_gaps, float), 90)))
        if len(rec.gaps) >= SPREAD_MIN:
            spread = _iqr(np.fromiter(rec.gaps, float))
        else:  # too few of its own: everyone's, or not known
            spread = _iqr(np.fromiter(self.prior, float)) if len(self.prior) >= PRIOR_MIN else math.inf
        return Expectation(key, rec.hashes, rec.ended_s, rec.ended_s + think, rec.ended_s + early,
                           rec.ended_s + late, rec.pattern, p, spread)


def _iqr(g: np.ndarray) -> float:
    low, high = np.percentile(g, [25, 75])
    return float(high - low)


def _pattern(rec: PrefixRecord) -> Pattern:
    if rec.repeats >= PERIODIC_MIN and len(rec.gaps) >= PERIODIC_MIN:
        g = np.fromiter(rec.gaps, float)
        if g.mean() > 0 and g.std() / g.mean() <= PERIODIC_CV:
            return Pattern.PERIODIC
    return Pattern.RECURRING if rec.extended or rec.repeats else Pattern.UNKNOWN
