"""The steps a worker reports (`pdserve.worker.step_times.StepTimes`): a step runs on to the next one's start when
the loop went straight on to it, and stands alone when the loop waited in between."""

from __future__ import annotations

from types import SimpleNamespace

from pytest import approx

from pdserve.worker.step_times import MAX_ROWS, StepTimes


def _decode(context: int):  # (`StepRow.of` reads a step's chunks: one token at context - 1 is a decode)
    return SimpleNamespace(chunks=[SimpleNamespace(token_ids=[7], start_pos=context - 1)])


def test_a_step_runs_on_to_the_next_start_through_the_loop_work():
    t = StepTimes()
    t.started(10.0)
    t.ended(_decode(65), 0.040, 10.040)
    assert t.rows == []  # pending until the loop goes on or waits
    t.started(10.043)  # 3 ms of loop work
    t.ended(_decode(66), 0.041, 10.084)
    assert t.rows == [[0, 0, 1, 65, approx(0.043), 0]]
    t.waited()  # nothing more to step: the last one alone
    assert [r[4] for r in t.take()] == approx([0.043, 0.041])
    assert t.take() == []


def test_a_wait_between_two_steps_is_not_a_step_cost():
    t = StepTimes([[16, 256, 0, 0, 0.02]])  # a calibration row goes out first
    t.started(0.0)
    t.ended(_decode(10), 0.05, 0.05)
    t.waited()  # a cadence hold, a held prefill worker, or idle
    t.started(1.0)
    t.ended(_decode(11), 0.05, 1.05)
    t.started(1.051)
    assert [r[4] for r in t.take()] == approx([0.02, 0.05, 0.051])


def test_rows_between_two_stats_are_bounded():
    t = StepTimes()
    for i in range(MAX_ROWS + 10):
        t.started(float(i))
        t.ended(_decode(5), 0.5, i + 0.5)
    t.waited()
    assert len(t.take()) == MAX_ROWS


def test_a_prefill_chunk_reports_its_prefix_term():
    """A chunk of 16 tokens after 32 cached (a reused prefix): its row carries 16 x 32 as `prefill_prefix`, the
    sixth number (`online_fit.REPORTED`), beside 16 tokens and 16^2; a chunk from position 0 has none."""
    t = StepTimes()
    for start in (32, 0):
        t.started(float(start))
        t.ended(SimpleNamespace(chunks=[SimpleNamespace(token_ids=list(range(16)), start_pos=start)]), 0.1,
                start + 0.1)
    t.waited()
    assert [r[:4] + r[5:] for r in t.take()] == [[16, 256, 0, 0, 512], [16, 256, 0, 0, 0]]
