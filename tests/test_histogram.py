"""Histogram: counts equal np.histogram's per column, exactly, on every mesh."""

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import sharded_scan as ss
from sharded_scan.combiners.statistics import histogram
from tests.helpers import assert_usage_error


def rows(n, d=3, seed=0):
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


def reference(x, bins, ranges):
    ranges = np.broadcast_to(np.asarray(ranges, np.float64), (x.shape[1], 2))
    return np.stack([np.histogram(np.asarray(x[:, j], np.float64), bins, r)[0] for j, r in enumerate(ranges)])


# One device, eight (ragged), and a 2-D mesh: counts merge by psum like Sum's, whose data:2 is test_engine's
@pytest.mark.parametrize("mesh", ["data:1", "data:8", "data:4,model:2"])
@pytest.mark.parametrize("n", [1, 5, 1009])
def test_counts_equal_numpy(mesh, n):
    x = rows(n)
    got = ss.run(ss.Histogram(7, (-1.5, 2.0)), x, mesh=mesh, microbatch=8, steps_per_call=2)
    np.testing.assert_array_equal(got.counts, reference(x, 7, (-1.5, 2.0)))
    np.testing.assert_array_equal(got.edges, np.histogram(x[:, 0], 7, (-1.5, 2.0))[1])


def test_edges_values_outside_nan_and_per_column_ranges():
    edges = np.linspace(-1.0, 1.2, 11)  # no edge at 0: XLA flushes subnormals (nextafter(0)) to zero
    column = np.concatenate([edges, np.nextafter(edges.astype(np.float32), np.float32(np.inf)),
                             np.nextafter(edges.astype(np.float32), np.float32(-np.inf)), [np.nan, -5, 5]])
    x = np.stack([column, column[::-1] * 3], axis=1).astype(np.float32)
    ranges = [(-1.0, 1.2), (-3.6, 2.9)]
    got = ss.run(ss.Histogram(10, ranges), x, microbatch=4)
    np.testing.assert_array_equal(got.counts, reference(x, 10, ranges))
    assert got.counts[0].sum() < len(column) and got.edges.shape == (2, 11)


def test_independent_of_microbatch_and_bfloat16_and_int_inputs():
    x = rows(1009, seed=1)
    want = reference(x, 7, (-1.5, 2.0))
    for microbatch, steps in [(1, 1), (8, 2)]:  # (8, 2): test_counts_equal_numpy's data:8 program, other rows
        got = ss.run(ss.Histogram(7, (-1.5, 2.0)), x, mesh="data:8", microbatch=microbatch, steps_per_call=steps)
        np.testing.assert_array_equal(got.counts, want)
    xb = x.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(ss.run(ss.Histogram(5, (-2, 2)), xb).counts, reference(xb, 5, (-2, 2)))
    xi = np.arange(300, dtype=np.int32).reshape(100, 3) % 17
    np.testing.assert_array_equal(ss.run(ss.Histogram(4, (0, 16)), xi).counts, reference(xi, 4, (0, 16)))


def test_merge_adds_counts_with_init_as_identity():
    combiner, spec = ss.Histogram(4, (0, 1)), jax.ShapeDtypeStruct((3,), np.float32)
    x = np.random.default_rng(2).random((8, 3)).astype(np.float32)
    mask = np.arange(8) < 5
    a = jax.jit(combiner.add)(combiner.init(spec), x, mask)  # as the engine runs it: one program, not op by op
    np.testing.assert_array_equal(combiner.merge(combiner.init(spec), a), a)
    np.testing.assert_array_equal(combiner.finalize(jax.device_get(a)).counts, reference(x[:5], 4, (0, 1)))


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: ss.Histogram(0, (0, 1)), ["bins=0"]),
        (lambda: ss.Histogram(2.5, (0, 1)), ["bins=2.5"]),
        (lambda: ss.Histogram(4, None), ["range"]),
        (lambda: ss.Histogram(4, (1, 1)), ["lo < hi"]),
        (lambda: ss.Histogram(4, (0, np.inf)), ["finite"]),
        (lambda: ss.Histogram(4, (0, 1, 2)), ["(d, 2)"]),
        (lambda: ss.run(ss.Histogram(4, [(0, 1)] * 2), rows(10)), ["2 per-column ranges", "3 columns"]),
        (lambda: ss.run(ss.Histogram(4, (0, 1)), rows(10).reshape(10, 3, 1)), ["(d,)"]),
    ],
)
def test_bad_arguments_are_one_clear_line(make, words):
    assert_usage_error(make, words)


def test_subnormal_edges_are_one_line_never_every_row_in_the_last_bin():
    # issue 42, finding 7: Histogram(4, (0, 4e-310)) put every row in the last bin (numpy [0, 1, 1, 1]): its float32
    # edges are subnormal, which XLA on CPU reads as 0. One line before compute; edges of normal floats still fine.
    assert_usage_error(lambda: ss.Histogram(4, (0, 4e-310)), ["(0.0, 4e-310)", "smallest normal", "flushes"])
    assert_usage_error(lambda: ss.Histogram(3, np.array([[0, 1], [-1e-40, 0]])), ["(-1e-40, 0.0)", "scale"])
    for bins, lo_hi in ((4, (0, 1e-37)), (2, (-1, 1)), (1000, (-1e-30, 1e-30))):
        ss.Histogram(bins, lo_hi)


def _subnormal_compare_by_every_edge(lo, hi, bins):
    tiny = np.finfo(np.float32).tiny
    edges = np.linspace(lo, hi, bins + 1)
    compared = np.concatenate([histogram._float32_at_least(edges[:-1]), histogram._float32_at_most(edges[-1:])])
    return bool(((compared != 0) & (np.abs(compared) < tiny)).any())


@settings(max_examples=300)
@given(st.floats(-1e-30, 1e-30, allow_subnormal=True), st.floats(0, 1e-30, allow_subnormal=True),
       st.sampled_from([1, 2, 3, 7, 100, 4097]))
def test_edge_check_by_bisection_equals_checking_every_edge(lo, width, bins):
    # The check looks at a few edges, not bins + 1 of them: Histogram(10**9, ...) made 8 GB of edges
    # (20 GB resident) before admission could refuse it. It must still say what every edge would.
    hi = lo + width
    if not lo < hi:
        return
    np.testing.assert_array_equal(histogram.edges_at(lo, hi, bins, np.arange(bins + 1)), np.linspace(lo, hi, bins + 1))
    assert histogram._has_subnormal_compare(lo, hi, bins) == _subnormal_compare_by_every_edge(lo, hi, bins)


def test_a_billion_bins_are_checked_without_making_their_edges():
    assert_usage_error(lambda: ss.Histogram(10**9, (0, 1e-30)), ["smallest normal"])
    ss.Histogram(10**12, (-1.0, 1.0))
