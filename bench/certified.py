"""Certified reference problems (NIST StRD) and their LRE scores, for tests and bench.

- Univariate summary statistics: NumAcc1-4 (certified mean and sample sd).
- Linear least squares: Longley (``statsmodels.datasets.longley``), Wampler1, Wampler2.

Scores are McCullough's (1998) log relative error, ``LRE = -log10(|got - cert| / |cert|)``:
the number of correct significant digits, capped at the 15 digits NIST certifies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from fractions import Fraction

import numpy as np

DIGITS = 15.0  # NIST certifies 15 significant digits

# NIST StRD Longley, intercept first (https://www.itl.nist.gov/div898/strd/lls/data/Longley.shtml).
LONGLEY_COEF = (
    -3482258.63459582, 15.0618722713733, -0.358191792925910e-01, -2.02022980381683,
    -1.03322686717359, -0.511041056535807e-01, 1829.15146461355,
)


def lre(got, cert) -> float:
    """The smallest LRE over the entries of ``got`` against ``cert``, capped at :data:`DIGITS`."""
    got, cert = np.asarray(got, np.float64).ravel(), np.asarray(cert, np.float64).ravel()
    with np.errstate(divide="ignore", invalid="ignore"):
        digits = -np.log10(np.abs(got - cert) / np.abs(cert))
    digits = np.where(np.isnan(digits), 0.0, digits)
    return float(np.clip(digits, 0.0, DIGITS).min())


def numacc() -> dict[str, tuple[np.ndarray, float, float]]:
    """NumAcc1-4: ``name -> (values, certified mean, certified sample sd)``."""
    out = {"NumAcc1": (np.array([10000001.0, 10000003.0, 10000002.0]), 10000002.0, 1.0)}
    for name, base in (("NumAcc2", 0.0), ("NumAcc3", 1000000.0), ("NumAcc4", 10000000.0)):
        pairs = [float(Fraction(base) + Fraction(v)) for v in ("1.1", "1.3")] * 500
        values = np.array([float(Fraction(base) + Fraction("1.2")), *pairs])
        out[name] = (values, float(Fraction(base) + Fraction("1.2")), 0.1)
    return out


def wampler(coef: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Wampler data: ``x = 0..20``, ``X = [x, x², ..., x⁵]``, ``y = Σ coef_i x^i`` rounded once."""
    x = np.arange(21)
    y = np.array([float(sum(Fraction(c) * int(v) ** i for i, c in enumerate(coef))) for v in x])
    return np.stack([x.astype(np.float64) ** i for i in range(1, 6)], axis=1), y


def regressions() -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``name -> (X, y, certified coefficients with the intercept first)``."""
    from statsmodels.datasets import longley

    data = longley.load_pandas()
    w1 = ("1", "1", "1", "1", "1", "1")
    w2 = ("1", "0.1", "0.01", "0.001", "0.0001", "0.00001")
    return {
        "Longley": (data.exog.to_numpy(np.float64), data.endog.to_numpy(np.float64), np.array(LONGLEY_COEF)),
        "Wampler1": (*wampler(w1), np.array([float(Fraction(c)) for c in w1])),
        "Wampler2": (*wampler(w2), np.array([float(Fraction(c)) for c in w2])),
    }


def sharded_scan_scores(dtype, meshes=("data:1", "data:3", "data:8"), microbatches=(2, 5), solvers=None) -> dict:
    """The worst LRE of sharded_scan over ``meshes`` x ``microbatches``, per problem and solver.

    ``{"regression": {solver: {name: lre}}, "moments": {name: {"mean": lre, "sd": lre}}}``.
    float64 data runs in 64 bits with or without ``jax_enable_x64`` (a run scopes it).
    """
    import sharded_scan as ss
    from sharded_scan.combiners.linalg.solvers import SOLVERS

    out: dict = {"regression": {}, "moments": {}}
    for solver in solvers or SOLVERS:
        scores = out["regression"].setdefault(solver, {})
        for name, (x, y, cert) in regressions().items():
            for mesh in meshes:
                for mb in microbatches:
                    got = ss.run(ss.LinearRegression(solver=solver), (x.astype(dtype), y.astype(dtype)),
                                 mesh=mesh, microbatch=mb)
                    score = lre(np.concatenate([[got.intercept], got.coef]), cert)
                    scores[name] = min(scores.get(name, DIGITS), score)
    for name, (values, mean, sd) in numacc().items():
        worst = {"mean": DIGITS, "sd": DIGITS}
        for mesh in meshes:
            for mb in microbatches:
                got = ss.run(ss.Moments(ddof=1), values.astype(dtype)[:, None], mesh=mesh, microbatch=mb)
                worst["mean"] = min(worst["mean"], lre(got.mean, mean))
                worst["sd"] = min(worst["sd"], lre(np.sqrt(got.var), sd))
        out["moments"][name] = worst
    return out


def peer_scores(dtype) -> dict:
    """The same problems through numpy ``lstsq``/``mean``/``std``, scikit-learn and statsmodels."""
    import statsmodels.api as sm
    from sklearn.linear_model import LinearRegression

    out: dict = {"regression": {}, "moments": {}}
    for name, (x, y, cert) in regressions().items():
        x, y = x.astype(dtype), y.astype(dtype)
        design = np.hstack([np.ones((len(x), 1), dtype), x])
        fits = {
            "numpy lstsq": np.linalg.lstsq(design, y, rcond=None)[0],
            "scikit-learn": (lambda m: np.concatenate([[m.intercept_], m.coef_]))(LinearRegression().fit(x, y)),
            "statsmodels": np.asarray(sm.OLS(y, design).fit().params),
        }
        for peer, coef in fits.items():
            out["regression"].setdefault(peer, {})[name] = lre(coef, cert)
    for name, (values, mean, sd) in numacc().items():
        v = values.astype(dtype)
        out["moments"][name] = {"mean": lre(np.mean(v), mean), "sd": lre(np.std(v, ddof=1), sd)}
    return out


def run_x64(code: str, timeout: float = 600) -> dict:
    """Runs ``code`` in a fresh Python with ``jax_enable_x64`` and 8 CPU devices; returns
    the JSON object it prints on its last line (``emit(obj)`` prints one).

    The global flag in a process of its own, as a user who sets it at start-up runs (a run of
    64-bit data without it scopes ``jax.enable_x64`` itself, its reader thread included).
    """
    prelude = (
        "import json, jax\n"
        "jax.config.update('jax_enable_x64', True)\n"
        "jax.config.update('jax_num_cpu_devices', 8)\n"
        "def emit(obj):\n"
        "    print(json.dumps(obj, default=float))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
        cwd=root, env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the x64 subprocess failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
