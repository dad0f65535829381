"""The steps a worker reports, timed as a request waits for them: from one step's start to the next's.

A worker's stats carry its recent steps (`StepRow.reported`): the conductor's admission model learns its time
model from them, and `pdserve profile --from-server` fits the simulator's from them. Between two steps of a
busy worker its loop sends the step's outputs, takes commands, polls arriving KV and does the transfer
bookkeeping; a running request waits for that work as for the step itself. Measured on this project's 2-vCPU
Intel Xeon: ~0.5 ms after a 57 ms decode step of a request alone on a quiet host (~1%); with other processes on
the cores (the Azure conversation trace at 0.5 req/s beside another benchmark) 2.3 ms median, 5.2 ms mean,
10 ms p90 after 80 ms steps (~6%), which a model of the steps alone misses.

So a step is reported as the time from its start to the start of the next step when the loop went straight on
to it, and as the step alone when the loop waited in between (idle, a paced or held worker, a cadence hold):
a wait is not the step's cost.
"""

from __future__ import annotations

from pdserve.core.sched.online_fit import StepRow

MAX_ROWS = 64  # steps kept between two stats (a worker sends its stats every 0.25 s)


class StepTimes:
    def __init__(self, rows: list[list] | None = None) -> None:
        self.rows: list[list] = list(rows or [])  # reported rows not yet sent
        self._pending: tuple[StepRow, float] | None = None  # the last step and when its forward ended

    def started(self, now: float) -> None:
        """A step starts at `now` (perf_counter): the previous one, if the loop went straight on, is logged
        with the loop work in between."""
        if self._pending is not None:
            row, ended = self._pending
            self._log(row, row.seconds + max(now - ended, 0.0))

    def ended(self, scheduled, seconds: float, now: float) -> None:
        """A step of `scheduled` ran `seconds` and ended at `now` (perf_counter)."""
        self.waited()  # (defensive: `started` has logged the previous one)
        if scheduled is not None:
            self._pending = (StepRow.of(scheduled, seconds), now)

    def waited(self) -> None:
        """The loop is about to wait (nothing to step, held, a cadence hold): the pending step goes alone."""
        if self._pending is not None:
            row, _ = self._pending
            self._log(row, row.seconds)

    def take(self) -> list[list]:
        rows, self.rows = self.rows, []
        return rows

    def _log(self, row: StepRow, seconds: float) -> None:
        self._pending = None
        if len(self.rows) < MAX_ROWS:
            self.rows.append(StepRow(row.prefill_tokens, row.prefill_sq, row.prefill_prefix, row.decode_seqs,
                                     row.decode_context, seconds).reported())
