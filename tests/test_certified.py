"""Certified references (NIST StRD), scored by LRE, at several device counts and micro-batches
far smaller than the data (so folds and merges run): float64 (64-bit data runs in 64 bits), and float32.

The figures and the peers' scores are in ``python bench/accuracy.py``.
"""

import numpy as np
import pytest

import sharded_scan as ss
from bench import certified

MICROBATCHES = (3,)  # the data has 16 (Longley), 21 (Wampler) and 1001 (NumAcc) rows
MESHES = ("data:8",)  # float64; float32 on data:3 (bench/accuracy.py runs 1, 3 and 8 for both)


def test_float64_regression_and_moments_reach_the_certified_digits():
    # In this process: 64-bit data runs in 64 bits without jax_enable_x64 (dtypes.x64_scope), so no
    # interpreter of its own (~2 s of CPU); the global flag's own path is tests/test_exact_counts.py's.
    pytest.importorskip("statsmodels")
    got = certified.sharded_scan_scores(np.float64, MESHES, solvers=["whitened"], microbatches=MICROBATCHES)
    rng = np.random.default_rng(0)  # independent columns with variances 1 and 1e8: not "singular"
    scale = np.array([1.0, 1e4, 1.0, 1e4, 1.0])  # Wampler's 5 columns: the same compiled program
    x = rng.normal(0, 1, (500, 5)) * scale
    y = x @ (1 / scale) + rng.normal(0, 0.1, 500)
    fit = ss.run(ss.LinearRegression(), (x, y), mesh="data:8", microbatch=3)
    assert fit.coef.dtype == np.float64  # float64 all the way, not narrowed
    want = np.linalg.lstsq(np.hstack([x, np.ones((500, 1))]), y, rcond=None)[0]
    got["scaled"] = {"rank": fit.rank, "err": float(np.abs(fit.coef / want[:5] - 1).max())}
    for name, score in got["regression"]["whitened"].items():
        assert score >= 9, (name, score)  # numpy lstsq: 10.9 / 9.6 / 10.4
    for name, score in got["moments"].items():
        assert score["mean"] >= 8 and score["sd"] >= 8, (name, score)
    assert got["scaled"]["rank"] == 5 and got["scaled"]["err"] < 1e-12


def test_float32_regression_and_moments_keep_what_float32_holds():
    pytest.importorskip("statsmodels")
    ours = certified.sharded_scan_scores(np.float32, ("data:3",), solvers=["whitened"], microbatches=MICROBATCHES)
    numpy32 = certified.peer_scores(np.float32)["moments"]
    scores = ours["regression"]["whitened"]
    # Longley's data rounded to float32 allows 4.9 digits (numpy computes float32 lstsq in
    # float64); LAPACK's float32 sgelsd gets 0.0 here.
    assert scores["Longley"] >= 4
    # Wampler2: 4.8 from float64 arithmetic on the rounded data; float32 Householder QR 3.8.
    assert scores["Wampler2"] >= 3.4
    for name in ("NumAcc1", "NumAcc2"):  # where the values fit float32
        assert ours["moments"][name]["mean"] >= numpy32[name]["mean"], name
        assert ours["moments"][name]["sd"] >= numpy32[name]["sd"] - 0.15, name  # numpy's is the data's own limit
