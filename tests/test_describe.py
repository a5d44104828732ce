"""Describe: df.describe() in one pass (or exactly), against pandas' float64 answers; to_pandas, to_json."""

import importlib
import json
import os

import numpy as np
import pandas as pd
import pytest

import sharded_scan as ss
from launch.data import make_source
from launch.main import run_job
from tests.helpers import assert_usage_error
from tests.test_checkpoint import CrashError, crash_at

KW = {"microbatch": 16, "steps_per_call": 2}


def data(n, seed=0):
    """float32 columns users have: normal with NaNs here and there, lognormal, small integers with
    a run of NaN, a column of one NaN row, and a constant one."""
    r = np.random.default_rng(seed)
    x = np.stack([r.normal(3, 2, n), r.lognormal(0, 1.5, n), r.integers(0, 5, n), r.normal(size=n),
                  np.full(n, 7.25)], 1).astype(np.float32)
    x[r.random(n) < 0.2, 0] = np.nan
    x[n // 3: n // 2, 2] = np.nan
    x[n // 2, 3] = np.nan
    return pd.DataFrame(x, columns=["height", "income", "kids", "noise", "constant"])


def check_like_pandas(got, frame, percentiles=None, rtol=1e-5):
    want = frame.astype(np.float64).describe(percentiles=percentiles)
    table = got.to_pandas()
    assert table.index.tolist() == want.index.tolist() and table.columns.tolist() == want.columns.tolist()
    exact_rows = ["count", "min", "max"]
    pd.testing.assert_frame_equal(table.loc[exact_rows], want.loc[exact_rows])
    pd.testing.assert_frame_equal(table, want, rtol=rtol, atol=1e-6)


# Programs are compiled per layout (a job of fewer rows than a step's cuts a smaller one): one row is its own, on
# one device (its programs compile in about half of two devices'; Describe's merge of an empty device's partial:
# test_float_extremes, two rows on eight devices); 101 rows on 2 devices is test_integer_columns_and_infinities'
# program, 997 rows on 8 devices with the describe config's percentiles that of the config tests and test_to_json.
PERCENTILES = importlib.import_module("configs.describe").PERCENTILES


@pytest.mark.parametrize("mesh, n, percentiles", [("data:1", 1, None), ("data:2", 101, None),
                                                  ("data:8", 997, PERCENTILES)])
def test_one_pass_is_pandas_describe_with_nans_on_any_device_count(mesh, n, percentiles):
    frame = data(n)
    describe = ss.Describe() if percentiles is None else ss.Describe(percentiles=percentiles)
    got = ss.run(describe, frame, mesh=mesh, **KW)  # nothing compacted: the percentiles exactly
    check_like_pandas(got, frame, percentiles=percentiles)
    np.testing.assert_array_equal(got.nan_count, frame.isna().sum().to_numpy())
    np.testing.assert_array_equal(got.rank_error, 0)
    assert got.count.dtype == np.int64 and got.passes == 1


def test_compacted_sketch_percentiles_are_within_their_rank_error_and_exact_mode_is_nanquantile():
    frame = data(3001)
    x = frame.to_numpy(np.float64)
    qs = [0.01, 0.99]
    # One device (its programs compile in about two thirds of two's): compacted sketches merged over devices within
    # their bound: test_quantiles (data:8); Describe's merges over devices: the one-pass cases, test_wide_model.
    got = ss.run(ss.Describe(percentiles=(0.01, 0.99), k=16), frame, mesh="data:1", **KW)
    np.testing.assert_array_equal(got.qs, qs)
    assert np.all(got.rank_error[:4] > 0)
    for j in range(4):
        values = np.sort(x[:, j][~np.isnan(x[:, j])])
        n = len(values)
        for q, value in zip(qs, got.percentiles[j], strict=True):
            below, upto = np.searchsorted(values, value), np.searchsorted(values, value, "right")
            slack = got.rank_error[j] * n + 1  # an interpolated value sits between two ranks
            assert below - slack <= q * (n - 1) <= upto - 1 + slack, (j, q)
    # refined with bits=6 (65 boundaries a rank; the default's 1025, test_quantiles' exact mode, counted 16 times as
    # much at each refining step)
    exact = ss.run(ss.Describe(percentiles=(0.01, 0.99), k=16, exact=True, bits=6), frame, mesh="data:1", **KW)
    assert exact.passes > 1
    np.testing.assert_array_equal(exact.rank_error, 0)
    np.testing.assert_allclose(exact.percentiles, np.nanquantile(x, qs, axis=0).T, rtol=1e-12)
    check_like_pandas(exact, frame, percentiles=[0.01, 0.99])


def test_a_pytree_of_columns_gives_a_pytree_of_results_with_their_names():
    frame = data(300)
    features, y = frame[["height", "income"]], frame["kids"].rename("target")
    vector = frame["noise"].to_numpy()  # one unnamed column; a leaf here, not a program of its own
    got = ss.run(ss.Describe(), (features, y, vector), mesh="data:1", **KW)  # one device: cheaper programs
    assert isinstance(got, tuple) and len(got) == 3
    check_like_pandas(got[0], features)
    check_like_pandas(got[1], y.to_frame())
    assert got[1].columns.tolist() == ["target"]
    assert got[2].to_pandas().columns.tolist() == [0]
    np.testing.assert_allclose(got[2].to_pandas()[0], frame[["noise"]].astype(np.float64).describe()["noise"],
                               rtol=1e-5)


def test_to_json_writes_the_features_a_pipeline_normalizes_with(tmp_path):
    frame = data(500).rename(columns={"constant": "empty"})  # five columns: the others' compiled programs
    frame["empty"] = np.float32(np.nan)
    # The describe config's percentiles, given out of order (sorted, that combiner): its compiled programs.
    got = ss.run(ss.Describe(percentiles=sorted(PERCENTILES, reverse=True)), frame, mesh="data:8", **KW)
    path = tmp_path / "stats.json"
    written = got.to_json(path)
    back = json.loads(path.read_text())
    assert back == written and back["format"] == "sharded_scan.describe/1" and back["passes"] == 1
    assert list(back["features"]) == frame.columns.tolist()
    want = frame.astype(np.float64)
    for name, row in back["features"].items():
        assert set(row) == {"count", "nan_count", "mean", "std", "min", "max", "q01", "q25", "q50", "q75", "q99"}
        if name == "empty":
            assert row["count"] == 0 and row["nan_count"] == 500 and row["mean"] is None and row["q99"] is None
            continue
        column = want[name].dropna()
        assert row["count"] == len(column) and row["min"] == column.min() and row["max"] == column.max()
        np.testing.assert_allclose([row["mean"], row["std"], row["q01"], row["q25"], row["q50"], row["q99"]],
                                   [column.mean(), column.std(), *column.quantile([0.01, 0.25, 0.5, 0.99])],
                                   rtol=1e-5)


def test_integer_columns_and_infinities():
    r = np.random.default_rng(2)
    ints = pd.DataFrame({"a": r.integers(-50, 50, 400), "b": r.integers(0, 3, 400),
                         # past 2^24, where float32 rounds: seconds since 1970, spread over a day
                         "c": 1_700_000_000 + r.integers(0, 86_400, 400)}).astype(np.int32)
    # The integers' folds on one device (its programs compile in about half of two devices'); integer columns' moments
    # merged over devices: test_dtypes (int32 past 2^30, int64, uint64 on eight)
    got = ss.run(ss.Describe(), ints, mesh="data:1", **KW)
    want = ints.astype(np.float64).describe()
    pd.testing.assert_frame_equal(got.to_pandas().loc[["count", "min", "max"]], want.loc[["count", "min", "max"]])
    pd.testing.assert_frame_equal(got.to_pandas(), want, rtol=1e-12)
    top = (2**32 - 1 - r.integers(0, 7, (400, 1))).astype(np.uint32)
    m = ss.run(ss.Moments(), top, mesh="data:1", **KW)
    assert (m.min, m.max) == (top.min(), top.max()), (m.min, m.max)
    np.testing.assert_allclose(m.var, top.astype(np.float64).var(), rtol=1e-12)
    x = r.normal(size=(400, 5)).astype(np.float32)  # data()'s five columns: the same compiled program
    x[3, 1] = np.inf
    got = ss.run(ss.Describe(), x, mesh="data:2", **KW)
    assert got.max[1] == np.inf and got.count[1] == 400 and got.mean[1] == np.inf and np.isnan(got.std[1])  # pandas'
    np.testing.assert_array_equal(got.percentiles[1], np.quantile(x[:, 1].astype(np.float64), [0.25, 0.5, 0.75]))


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: ss.Describe(percentiles=(0.5, 2)), ["Describe", "[0, 1]"]),
        (lambda: ss.Describe(k=2), ["k", ">= 16"]),
        (lambda: ss.run(ss.Describe(), np.zeros((4, 2, 2), np.float32)), ["Describe", "(d,)"]),
    ],
)
def test_bad_arguments_are_one_line(make, words):
    assert_usage_error(make, words)


def test_the_describe_config_writes_the_json_next_to_the_result(tmp_path):
    config = importlib.import_module("configs.describe").get_config("quick")
    config.data.features = 5  # float32, micro-batch 16, steps_per_call 2 on 8 devices: the data:8 case's program
    result, summary = run_job(config, str(tmp_path))
    stats = json.loads((tmp_path / "describe.json").read_text())
    assert {"describe.json", "result.npz", "summary.json"} <= set(os.listdir(tmp_path))
    x = make_source(config.data).read(0, 1000).astype(np.float64)
    for j, name in enumerate(["0", "1", "2", "3", "4"]):
        row = stats["features"][name]
        assert row["count"] == 1000 and row["min"] == x[:, j].min() and row["max"] == x[:, j].max()
        np.testing.assert_allclose([row["mean"], row["std"], row["q01"], row["q99"]],
                                   [x[:, j].mean(), x[:, j].std(ddof=1), *np.quantile(x[:, j], [0.01, 0.99])],
                                   rtol=1e-5)
    again, done = run_job(config, str(tmp_path))
    assert done["already_done"] and json.loads((tmp_path / "describe.json").read_text()) == stats


def reject(constant):
    raise ValueError(f"not strict JSON: {constant}")


def test_infinities_from_parquet_write_every_output_and_a_deleted_describe_json_is_written_again(tmp_path):
    """Issue 42, finding 11: a Parquet file holding inf wrote result.npz, then failed on describe.json (not JSON
    compliant), status 1; the rerun said "already done" and describe.json never appeared, nor once deleted."""
    x = np.random.default_rng(4).normal(size=(1000, 5)).astype(np.float32)  # the config test's shapes: its programs
    x[3, 1], x[5, 2] = np.inf, -np.inf
    pd.DataFrame(x, columns=list("abcde")).to_parquet(tmp_path / "inf.parquet")
    config = importlib.import_module("configs.describe").get_config("quick")
    config.data.kind, config.data.path = "parquet", str(tmp_path / "inf.parquet")
    work = tmp_path / "w"
    run_job(config, str(work))
    files = {name: json.loads((work / name).read_text(), parse_constant=reject)
             for name in ("describe.json", "result.json", "summary.json")}
    stats = files["describe.json"]["features"]
    assert stats["b"]["max"] == "inf" and stats["c"]["min"] == "-inf" and stats["a"]["max"] == x[:, 0].max()
    assert files["result.json"]["max"][1] == "inf" and files["result.json"]["min"][2] == "-inf"  # one spelling
    assert set(files["summary.json"]["outputs_sha256"]) == {"result.json", "result.csv", "describe.json"}
    table = pd.read_csv(work / "result.csv")
    assert table["max"][1] == np.inf and table["min"][2] == -np.inf and table["column"].tolist() == list("abcde")
    (work / "describe.json").unlink()
    _, again = run_job(config, str(work))
    assert "already_done" not in again and again["rows_this_run"] == 0  # written again from the final checkpoint
    assert json.loads((work / "describe.json").read_text(), parse_constant=reject)["features"] == stats
    assert run_job(config, str(work))[1]["already_done"]


def test_kill_and_resume_is_the_uninterrupted_result(tmp_path):
    # A resume on the same mesh is bitwise the uninterrupted run (DESIGN.md): no logical_shards needed, so the
    # programs of the data:2 case of test_one_pass_is_pandas_describe_... (five columns, KW's layout).
    frame, kw = data(997), KW
    want = ss.run(ss.Describe(), frame, mesh="data:2", **kw)
    # 32 steps of 32 rows: a save every 8 (each save a few hundredths of a second of CPU), killed after the first
    options = ss.CheckpointOptions(str(tmp_path), every_steps=8)
    with pytest.raises(CrashError):
        ss.run(ss.Describe(), frame, mesh="data:2", checkpoint=options, progress=crash_at(9), **kw)
    got, report = ss.run_with_report(ss.Describe(), frame, mesh="data:2", checkpoint=options, **kw)
    assert report.resumed_from_step == 8
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_run_traces_its_add_once(monkeypatch):
    """One scan a step (the add masks NaNs anyway), traced once: by the memory estimate, whose trace the
    first step reuses (on main 3 times: the estimate's own, then a scan for full steps and one for the ragged)."""
    calls = []
    add = ss.Describe.add
    monkeypatch.setattr(ss.Describe, "add", lambda self, *args: calls.append(1) or add(self, *args))
    frame = data(40)[["height"]]  # 3 steps of 16 rows on one device, the last ragged; one column: a small program
    check_like_pandas(ss.run(ss.Describe(), frame, mesh="data:1", microbatch=16), frame)
    assert len(calls) == 1


def test_the_columns_moments_are_only_what_describe_prints():
    """A column's state folds the mean, variance and extremes alone (no third or fourth moments, norms or
    zeros: their sums were most of the per-column compile), and the fingerprint names that state, so a
    checkpoint of another one is another job."""
    import jax

    from sharded_scan.combiners.statistics import describe

    spec = jax.ShapeDtypeStruct((1,), np.float32)
    kept, every = describe.COLUMN.init(spec), ss.Moments(ddof=1).init(spec)
    assert np.shape(kept.higher)[0] < np.shape(every.higher)[0]
    assert np.shape(kept.counts.limbs)[0] < np.shape(every.counts.limbs)[0]
    assert ss.Describe().fingerprint()["moments"] == repr(describe.COLUMN.fields)


def test_the_columns_moments_fold_together_with_moments_control_flow_and_resume_a_stacked_state():
    """Every column's moments fold at once, each column's values counted on their own (``FiniteMoments``' fold,
    not a ``vmap`` of one-column folds, under which each ``lax.cond`` became a select running both branches):
    the add keeps ``Moments``' conds and the sketch's, and its state is still a one-column state a column (what a
    checkpoint holds), so a fold of half the rows resumed is pandas' answer."""
    import jax

    from sharded_scan.combiners.statistics import describe
    from tests.test_quantiles import primitive_names

    spec = jax.ShapeDtypeStruct((5,), np.float32)
    x, mask = np.zeros((64, 5), np.float32), np.ones(64, bool)

    def conds(c, acc):
        return list(primitive_names(jax.make_jaxpr(c.add)(acc, x, mask).jaxpr)).count("cond")

    d = ss.Describe(k=256)
    assert conds(d, d.init(spec)) == conds(describe.COLUMN, describe.COLUMN.init(spec)) + conds(d.sketch,
                                                                                                  d.sketch.init(spec))
    frame, d = data(300, seed=4), ss.Describe()  # its default k: nothing compacted, the percentiles exact
    values = frame.to_numpy()
    add = jax.jit(d.add)
    acc = add(d.init(spec), values[:150], np.ones(150, bool))
    assert np.shape(acc.moments.min) == (5, 1)  # a one-column state a column
    acc = add(acc, values[150:], np.ones(150, bool))
    check_like_pandas(d.finalize(jax.tree.map(np.asarray, acc)), pd.DataFrame(values))
