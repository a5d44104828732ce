"""64-bit integers and floats at their extremes, as numpy treats them (issue 42, findings 5-9).

Every run takes ``microbatch=8, steps_per_call=1``: whatever the row count (at most 64), one step's
shapes, so each combiner, dtype and mesh compiles once for the whole module.
"""

import numpy as np
import pytest

import sharded_scan as ss

MESHES = ["data:1", "data:8"]
SMALL = {"microbatch": 8, "steps_per_call": 1}


def run(combiner, x, mesh):
    return ss.run(combiner, x, mesh=mesh, **SMALL)


@pytest.mark.parametrize("mesh", MESHES)
def test_a_constant_columns_variance_is_exactly_zero_at_any_magnitude(mesh):
    # finding 8: NaN on data:8 with a few rows (an empty device's partial merged in: its far shift made delta inf)
    for n in (2, 3, 9, 17):
        x = np.full((n, 2), 1e308)
        x[:, 1] = -1e308
        moments = run(ss.Moments(ddof=1), x, mesh)
        np.testing.assert_array_equal(moments.var, [0.0, 0.0])
        np.testing.assert_array_equal(moments.mean, x[0])
        np.testing.assert_array_equal(run(ss.Covariance(), x, mesh).cov, np.zeros((2, 2)))
        np.testing.assert_array_equal(run(ss.Moments(), np.full((n, 1), 3e38, np.float32), mesh).var, [0.0])
        if mesh == "data:8" and n in (2, 17):  # Describe's std: its one-column Moments, merged alike
            described = run(ss.Describe(), x, mesh)
            np.testing.assert_array_equal(described.std, [0.0, 0.0])
            np.testing.assert_array_equal(described.mean, x[0])


@pytest.mark.parametrize("mesh", MESHES)
def test_infinities_propagate_and_finite_means_stay_finite(mesh):
    # finding 9: the mean of [inf, 1, 2] was NaN (numpy: inf), that of [1e308, 1e308, -1e308] -inf (3.3e307)
    x = np.array([[np.inf, -np.inf, np.inf, 1e308, 3.0],
                  [1.0, 1.0, -np.inf, 1e308, 4.0],
                  [2.0, 2.0, 2.0, -1e308, 5.0]])
    got = run(ss.Moments(), x, mesh)
    with np.errstate(invalid="ignore", over="ignore"):
        np.testing.assert_array_equal(got.mean[:3], x[:, :3].mean(0))  # inf, -inf, NaN (numpy and pandas)
        np.testing.assert_array_equal(got.var[:3], x[:, :3].var(0))  # NaN
    np.testing.assert_array_equal(got.min, x.min(0))
    np.testing.assert_array_equal(got.max, x.max(0))
    assert got.mean[3] == pytest.approx(1e308 / 3, rel=1e-15)  # numpy's own mean overflows here: inf
    assert got.var[3] == np.inf  # the true variance, 8.9e615, overflows: inf, not NaN
    assert got.mean[4] == 4.0 and got.var[4] == pytest.approx(2 / 3, rel=1e-15)
    if mesh == "data:8":
        described = run(ss.Describe(), x, mesh)
        np.testing.assert_array_equal(described.mean[:3], [np.inf, -np.inf, np.nan])  # pandas' describe()
        assert described.mean[3] == pytest.approx(1e308 / 3, rel=1e-15)
        assert run(ss.Covariance(), x[:, 3:], mesh).mean[0] == pytest.approx(1e308 / 3, rel=1e-15)
    # rows far apart over many micro-batches and devices, float32 and float64: every merge and fold
    for big, dtype in ((1e308, np.float64), (3e38, np.float32)):
        far = np.array([big] * 40 + [-big] * 20, dtype)[:, None]
        mean = run(ss.Moments(), far, mesh).mean[0]
        assert mean == pytest.approx(np.float64(far[0, 0]) / 3, rel=1e-6 if dtype == np.float32 else 1e-14)
