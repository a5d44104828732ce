"""Compensated accumulation and nan_policy wrappers, against float64 references."""

import jax
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.combiners.wrappers import policies as wrappers
from sharded_scan.combiners.wrappers.policies import Compensated, NonFinite, NonFiniteError, apply_policies
from tests.helpers import f64, rel_err


def test_compensation_removes_float32_drift():
    # 2**18 single-row micro-batches of 0.1 on one device: plain float32 drifts visibly.
    x = np.full((2**18, 1), 0.1, np.float32)
    want = f64(x).sum(0)
    kw = dict(mesh="data:1", microbatch=1, steps_per_call=4096)
    plain = ss.run(ss.Sum(), x, compensated=False, **kw)
    kahan = ss.run(Compensated(ss.Sum()), x, compensated=False, **kw)
    default = ss.run(ss.Sum(), x, **kw)
    np.testing.assert_array_equal(default.sum, kahan.sum)
    assert rel_err(plain.sum, want) > 1e-4
    assert rel_err(kahan.sum, want) < 1e-7
    assert kahan.count == plain.count == 2**18


@pytest.mark.parametrize("mesh", ["data:1", "data:8"])
def test_compensated_gram_matches_float64(mesh):
    x = np.random.default_rng(0).normal(size=(333, 4)).astype(np.float32)
    got = ss.run(Compensated(ss.Gram()), x, mesh=mesh, microbatch=3)
    assert got.dtype == np.float32
    assert rel_err(got, f64(x).T @ f64(x)) < 1e-6


def test_compensation_needs_an_additive_combiner():
    class NotAdditive(ss.Sum):
        additive = False

    with pytest.raises(ss.UsageError, match="not additive"):
        Compensated(NotAdditive())


def with_bad_rows(n=101, d=3, bad=(5, 60)):
    x = np.random.default_rng(1).normal(size=(n, d)).astype(np.float32)
    x[bad[0], 1] = np.nan
    x[bad[1], 0] = np.inf
    return x, np.delete(x, bad, axis=0)


@pytest.mark.parametrize("mesh", ["data:1", "data:8"])
def test_omit_masks_rows_with_nan_or_inf(mesh):
    x, clean = with_bad_rows()
    got = ss.run(NonFinite(ss.Sum(), "omit_rows"), x, mesh=mesh, microbatch=4)
    assert got.count == len(clean)
    assert rel_err(got.sum, f64(clean).sum(0)) < 1e-6


@pytest.mark.parametrize("steps_per_call", [None, 1])  # 1: steps after the inf's step keep it inf, not NaN
def test_propagate_lets_nan_through_like_numpy(steps_per_call):
    x, _ = with_bad_rows()
    got = ss.run(apply_policies(ss.Sum(), nan_policy="propagate"), x, microbatch=4, steps_per_call=steps_per_call)
    assert np.isnan(got.sum[1]) and np.isinf(got.sum[0])


def test_raise_counts_bad_rows():
    x, _ = with_bad_rows()
    with pytest.raises(NonFiniteError, match="2 rows"):
        ss.run(NonFinite(ss.Sum(), "raise"), x, microbatch=4)


@pytest.mark.parametrize("bad_row, step_start", [(37, 32), (3, 0), (100, 96)])
def test_raise_through_run_names_the_first_bad_step(bad_row, step_start):
    x = np.ones((101, 2), np.float32)
    x[bad_row, 0] = np.nan
    x[bad_row + 1 :, 1] = np.inf  # later steps are bad too; the first one is named
    # 8 devices x 2 rows x 2 micro-batches: 32 rows a step.
    with pytest.raises(NonFiniteError, match=f"step starting at row {step_start}\\b") as err:
        ss.run(ss.Sum(), x, microbatch=2, steps_per_call=2, nan_policy="raise")
    assert "\n" not in str(err.value)


def test_run_nan_policy_omit():
    x, clean = with_bad_rows()
    got = ss.run(ss.Sum(), x, microbatch=4, nan_policy="omit")  # each NaN or inf adds nothing: pandas' sum()
    assert got.count == len(x)
    assert rel_err(got.sum, np.where(np.isfinite(x), f64(x), 0).sum(0)) < 1e-6


def test_unknown_policy_is_one_line_error():
    with pytest.raises(ss.UsageError, match="nan_policy"):  # checked once, in RunOptions; apply_policies trusts it
        ss.RunOptions(nan_policy="ignore")


def test_users_protocol_holds_no_engine_policy():
    members = {name for name in dir(ss.Combiner) if not name.startswith("_")}
    assert members == {
        "init", "add", "merge", "finalize", "additive", "check_spec", "fingerprint", "for_mesh", "partition",
        "convert", "operands", "bind", "takes_string_ids", "check_rows", "add_keyed", "add_omitting", "weighted",
        "data_part", "add_keyed_omitting", "merge_collectives", "operand_partition", "one_scan_per_step",
        "omitting_values", "add_finite", "add_keyed_finite", "finite_keep", "finite_values", "finalizes_stacked",
        "compiles_less_when_short", "microbatch_values",
    }
    raising = apply_policies(ss.Sum(), nan_policy="raise")
    assert wrappers.innermost(raising) == ss.Sum() and wrappers.innermost(ss.Sum()) == ss.Sum()
    assert wrappers.step_guard(ss.Sum()) is None  # a bare combiner has no per-step check
    assert wrappers.step_guard(apply_policies(ss.Sum(), nan_policy="omit")) is None
    spec = jax.ShapeDtypeStruct((2,), np.float32)
    assert wrappers.step_guard(raising) is raising and float(raising.health(raising.init(spec))) == 0.0
    with pytest.raises(NonFiniteError, match="rows 10..14"):
        raising.check_health(1.0, 10, 5)
    one_scan = [c.one_scan_per_step for c in (
        raising, apply_policies(ss.PCA(2), nan_policy="omit"), ss.LinearRegression())]
    assert one_scan == [False, True, True]


def test_wrappers_rebuild_around_the_inner_combiner_and_compare_by_value():
    job = NonFinite(Compensated(ss.Histogram(bins=4, range=(0.0, 1.0))), "omit")
    bound = job.bind(job.operands(jax.ShapeDtypeStruct((3,), np.float32)))
    assert type(bound) is NonFinite and bound.policy == "omit" and type(bound.inner) is Compensated
    assert job == NonFinite(Compensated(ss.Histogram(bins=4, range=(0.0, 1.0))), "omit")
    assert hash(job) == hash(NonFinite(Compensated(ss.Histogram(bins=4, range=(0.0, 1.0))), "omit"))
    assert job != NonFinite(Compensated(ss.Histogram(bins=4, range=(0.0, 1.0))), "raise")
    assert job.fingerprint() == {**ss.Histogram(bins=4, range=(0.0, 1.0)).fingerprint(), "compensated": "True",
                                 "nan_policy": "omit"}
