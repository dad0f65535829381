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
    assert t.rows == [[0, 0, 1, 65, approx(0.043)]]
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
