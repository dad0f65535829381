"""`OnlineFit`: its running minimum and its predictions against the plain computations over its rows."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.sched.online_fit import MIN_SAMPLES, WINDOW, OnlineFit


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=1, max_size=3 * WINDOW))
def test_fastest_is_the_minimum_of_the_rows_kept(seconds):
    fit = OnlineFit(2)
    for i, s in enumerate(seconds):
        fit.add((1.0, float(i)), s)
        assert fit.fastest() == min(row[-1] for row in fit.rows)
    assert len(fit.rows) == min(len(seconds), WINDOW)


def test_fastest_of_an_empty_fit_is_zero():
    assert OnlineFit(3).fastest() == 0.0


def test_predictions_are_the_fitted_coefficients_dot_the_shape():
    rng = np.random.default_rng(1)
    fit = OnlineFit(3)
    truth = np.array([0.002, 3e-5, 1e-9])
    for _ in range(MIN_SAMPLES - 1):
        x = (1.0, float(rng.integers(1, 4096)), float(rng.integers(0, 10**6)))
        fit.add(x, float(np.dot(truth, x)))
    assert fit.predict((1.0, 100.0, 0.0)) is None  # too few samples
    for _ in range(200):
        x = (1.0, float(rng.integers(1, 4096)), float(rng.integers(0, 10**6)))
        fit.add(x, float(np.dot(truth, x)))
        x = (1.0, 512.0, 512.0 * 512)
        assert fit.predict(x) == pytest.approx(float(np.dot(fit.coefficients(), x)), rel=1e-12)
    assert abs(fit.predict((1.0, 512.0, 512.0 * 512)) - float(np.dot(truth, (1.0, 512.0, 512.0 * 512)))) < 1e-9


def test_the_fit_is_made_over_the_rows_kept_in_their_order():
    from pdserve.core.sched.online_fit import REFIT_EVERY, nonnegative_lstsq
    rng = np.random.default_rng(2)
    fit = OnlineFit(3)
    for n in range(1, WINDOW * 2 + 5):
        x = (1.0, float(rng.integers(1, 4096)), float(rng.integers(0, 10**6)))
        fit.add(x, float(rng.random()))
        if n >= MIN_SAMPLES and n % 37 == 0:
            fit._new = REFIT_EVERY  # refit now
            rows = np.asarray(fit.rows, dtype=float)
            np.testing.assert_array_equal(fit.coefficients(), nonnegative_lstsq(rows[:, :3], rows[:, 3]))
