"""Inputs that used to be reduced silently wrong: an iterator with more or fewer rows than it
says, an accumulator that overflows on finite rows."""

import logging

import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.sources import IteratorSource

X = np.ones((5000, 2), np.float32)
KW = {"mesh": "data:2", "microbatch": 64, "steps_per_call": 2}


def batches(x, size=1000):
    return [x[i : i + size] for i in range(0, len(x), size)]


@pytest.mark.parametrize("num_rows, words", [
    (4900, ["yields 5000 rows, not num_rows=4900", "the last 100 would be dropped", "pass num_rows=5000"]),
    (5100, ["ended at row 5000, before its num_rows=5100"]),
])
def test_an_iterator_with_other_rows_than_it_says_is_one_line(num_rows, words):
    with pytest.raises(ss.UsageError) as err:
        ss.run(ss.Sum(), IteratorSource(batches(X), num_rows), **KW)
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_an_endless_iterator_is_named():
    def endless():
        while True:
            yield X[:100]

    with pytest.raises(ss.UsageError, match="yields more than .* rows, not num_rows=500 .it may be endless"):
        ss.run(ss.Sum(), IteratorSource(endless(), 500), **KW)


def test_an_accumulator_overflowing_on_finite_rows_raises_or_warns(caplog):
    x = np.full((64, 2), 3e37, np.float32)  # finite rows; their Gram is 5.8e76, beyond float32
    overflowed = r"the accumulator overflowed: \d+ of its values are inf or NaN although every row is finite"
    with pytest.raises(ss.UsageError, match=overflowed):
        ss.run(ss.Gram(), x, nan_policy="raise", **KW)
    with caplog.at_level(logging.WARNING, logger="sharded_scan.engine"):
        got = ss.run(ss.Gram(), x, **KW)
    assert np.isinf(got).all() and "accumulator values are inf or NaN" in caplog.text


def test_a_solve_that_fails_on_the_data_is_one_line():
    x = np.random.default_rng(0).normal(size=(100, 3)).astype(np.float32)
    x[5] = np.nan  # reaches the solve under the default nan_policy="propagate"
    with pytest.raises(ss.UsageError, match="LinearRegression could not finish on this data .*nan_policy='omit'"):
        ss.run(ss.LinearRegression(), (x, x.sum(1)), **KW)
