"""GroupBy and Weighted: per-key and weighted reductions against numpy per group."""

import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharded_scan as ss
from launch import data as launch_data
from launch.data import make_combiner, make_source
from sharded_scan.combiners import wide
from sharded_scan.combiners.statistics import sums
from tests.helpers import assert_usage_error, cpu_branch

K = 7
RUN = {"microbatch": 64, "steps_per_call": 2}  # one layout for every case: programs shared


def data(n=1000, seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.zipf(1.5, n).astype(np.int32) % K
    x = rng.normal(size=(n, 3)).astype(np.float32)
    w = rng.random(n).astype(np.float32)
    w[::5] = 0
    return keys, x, w


def test_groupby_sum_is_numpy_per_key():
    keys, x, _ = data(997)
    r = ss.run(ss.GroupBy(ss.Sum(), K), (keys, x), **RUN)
    np.testing.assert_allclose(r.sum, np.stack([x[keys == k].sum(0) for k in range(K)]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(r.rows, np.bincount(keys, minlength=K))
    np.testing.assert_array_equal(r.keys, np.arange(K))


def test_weighted_sum_is_np_average_parts_and_zero_weight_omits():
    keys, x, w = data()
    r = ss.run(ss.Weighted(ss.Sum()), (w, x), **RUN)
    np.testing.assert_allclose(r.sum / r.weight, np.average(x, axis=0, weights=w), rtol=1e-5)
    assert r.count == np.count_nonzero(w)
    g = ss.run(ss.GroupBy(ss.Weighted(ss.Sum()), K), (keys, (w, x)), **RUN)
    for k in range(K):
        np.testing.assert_allclose(g.sum[k], (w[keys == k, None] * x[keys == k]).sum(0), rtol=1e-5, atol=1e-5)
        assert g.result.count[k] == np.count_nonzero(w[keys == k])


def test_keys_out_of_range_are_one_line_or_an_other_row():
    keys, x, _ = data()
    bad = keys.copy()
    bad[[3, 10]] = [K, -2]
    with pytest.raises(ss.UsageError, match="2 rows have keys outside 0..6") as err:
        ss.run(ss.GroupBy(ss.Sum(), K), (bad, x), **RUN)
    assert "\n" not in str(err.value)
    r = ss.run(ss.GroupBy(ss.Sum(), K, out_of_range="other"), (bad, x), **RUN)
    assert r.keys[-1] == -1 and r.rows[-1] == 2
    np.testing.assert_allclose(r.sum[-1], x[[3, 10]].sum(0), rtol=1e-6)
    inside = (bad >= 0) & (bad < K)
    np.testing.assert_array_equal(r.rows[:K], np.bincount(bad[inside], minlength=K))


@pytest.mark.parametrize("combiner, rows, message", [
    (lambda: ss.GroupBy(ss.Sum(), 0), None, "num_keys must be a positive integer"),
    (lambda: ss.GroupBy(ss.Sum(), 3, out_of_range="drop"), None, "out_of_range must be one of"),
    (lambda: ss.GroupBy(ss.Quantiles(qs=[0.5], exact=True), 3), None, "reads the data several times"),
    (lambda: ss.Weighted(ss.Gradient(lambda p, x: x @ p, np.ones(3))),
     None, "takes no weights"),
    (lambda: ss.GroupBy(ss.Sum(), K), lambda k, x, w: (k.astype(np.float32), x), "keys must be integers"),
    (lambda: ss.GroupBy(ss.Sum(), K), lambda k, x, w: (np.stack([k, k], 1), x), "one integer a row"),
    (lambda: ss.GroupBy(ss.Sum(), K), lambda k, x, w: x, "runs on data \\(keys, data\\)"),
    (lambda: ss.Weighted(ss.Sum()), lambda k, x, w: (np.stack([w, w], 1), x), "one number a row"),
    (lambda: ss.Weighted(ss.Sum()), lambda k, x, w: (w[:-1], x), "different row counts"),
    (lambda: ss.Weighted(ss.Sum()), lambda k, x, w: (np.where(np.arange(w.size) == 4, -1, w), x),
     "1 rows have negative or non-finite weights \\(row 4"),
    (lambda: ss.Weighted(ss.Sum()), lambda k, x, w: (np.where(np.arange(w.size) == 4, np.inf, w), x),
     "negative or non-finite weights"),
])
def test_bad_inputs_are_one_line(combiner, rows, message):
    keys, x, w = data(50)
    with pytest.raises(ss.UsageError, match=message) as err:
        ss.run(combiner(), rows(keys, x, w), **RUN)
    assert "\n" not in str(err.value)


def test_a_bad_weight_is_named_by_its_row_of_the_data_where_a_policy_skips_rows_before_it():
    # nan_policy="omit_rows" checks the weights of the rows it folds only (a NaN row is skipped, not refused): the
    # one line named the bad weight's place among those, row 2 here, not its row of the data.
    keys, x, w = data(50)
    x[[1, 2]] = np.nan
    w = np.where(np.arange(w.size) == 4, -1, w)
    for combiner, rows in ((ss.Weighted(ss.Sum()), (w, x)), (ss.GroupBy(ss.Weighted(ss.Moments()), K), (keys, (w, x)))):
        with pytest.raises(ss.UsageError, match="1 rows have negative or non-finite weights \\(row 4: -1"):
            ss.run(combiner, rows, nan_policy="omit_rows", **RUN)


def test_fast_add_keyed_agree_with_numpy_per_key():
    """The built-ins' segment reductions (and from_fn's default) fold each row into its key's accumulator."""
    keys, x, w = data(300, seed=1)
    mask = np.arange(300) < 290  # the last rows are padding
    groups = [(keys == k) & mask for k in range(K)]
    ints = np.random.default_rng(1).integers(-2**31, 2**31 - 1, (300, 2), dtype=np.int64).astype(np.int32)

    def keyed(combiner, rows):
        spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), rows)
        acc = jax.tree.map(lambda a: jnp.broadcast_to(a, (K, *a.shape)), combiner.init(spec))
        return jax.jit(lambda a, r: combiner.add_keyed(a, r, mask, keys, K))(acc, rows)

    r = keyed(ss.Sum(), ints)
    np.testing.assert_array_equal(wide.to_int(r.sum), [ints[g].astype(np.int64).sum(0) for g in groups])
    np.testing.assert_array_equal(wide.to_int(r.count), [g.sum() for g in groups])
    counts = keyed(ss.Histogram(5, (-2, 2)).weighted(), (w, x))
    np.testing.assert_allclose(counts, [[np.histogram(x[g, j], 5, (-2, 2), weights=w[g])[0] for j in range(3)]
                                        for g in groups], atol=1e-5)
    counts = wide.to_int(keyed(ss.Histogram(5, (-2, 2)), x))
    np.testing.assert_array_equal(counts, [[np.histogram(x[g, j], 5, (-2, 2))[0] for j in range(3)] for g in groups])
    gram = keyed(ss.Gram(block=2), x)  # the triangle's block rows
    full = [sums.triangle_full(jax.tree.map(lambda a, k=k: a[k], gram)) for k in range(K)]
    np.testing.assert_allclose(full, [x[g].T @ x[g] for g in groups], rtol=1e-5, atol=1e-4)
    squares = ss.from_fn(lambda c, b: c + jnp.sum(b * b, 0), np.zeros(3, np.float32))
    np.testing.assert_allclose(keyed(squares, x), [(x[g] ** 2).sum(0) for g in groups], rtol=1e-5)


def test_keys_out_of_range_in_data_not_in_memory_fail_the_run_in_one_line_and_names_reach_to_pandas():
    pd = pytest.importorskip("pandas")
    keys, x, _ = data(300)
    frame = pd.DataFrame(x, columns=["a", "b", "c"])
    table = ss.run(ss.GroupBy(ss.Sum(), K), (keys, frame), **RUN).to_pandas()
    assert table.index.names == ["key", None] and table.loc[(2, "b"), "rows"] == np.count_nonzero(keys == 2)
    np.testing.assert_allclose(table.loc[(2, "b"), "sum"], x[keys == 2, 1].sum(), rtol=1e-5)
    keys[5] = K
    with pytest.raises(ss.UsageError, match="1 rows have keys outside 0..6; pass a larger num_keys") as err:
        ss.run(ss.GroupBy(ss.Sum(), K), (keys, frame), **RUN)
    assert "\n" not in str(err.value)


def test_groupby_resumes_and_splits_a_weighted_gram_per_key_over_model(tmp_path):
    keys, x, w = data(2500)

    class StopError(Exception):
        pass

    def stop_at_2(progress):
        if progress.step == 2:
            raise StopError

    options = ss.CheckpointOptions(str(tmp_path), every_steps=1)
    with pytest.raises(StopError):
        ss.run(ss.GroupBy(ss.Sum(), K), (keys, x), checkpoint=options, progress=stop_at_2, **RUN)
    resumed = ss.run(ss.GroupBy(ss.Sum(), K), (keys, x), checkpoint=options, **RUN)
    np.testing.assert_allclose(resumed.sum, [x[keys == k].sum(0) for k in range(K)], rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(resumed.rows, np.bincount(keys, minlength=K))

    job = ss.GroupBy(ss.Weighted(ss.Gram()), K)
    gram = ss.run(job, (keys, (w, x)), mesh="data:4,model:2", **RUN)  # (K, d, d) split by columns over model
    np.testing.assert_allclose(gram.result, [(x[keys == k] * w[keys == k, None]).T @ x[keys == k] for k in range(K)],
                               rtol=1e-5, atol=1e-4)
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), (keys, (w, x)))
    split = job.for_mesh(ss.make_mesh("data:4,model:2"))
    triangles = jax.jit(job.add)(job.init(spec), (keys, (w, x)), np.ones(len(keys), bool))
    columns = jax.jit(lambda acc: split.convert(acc, job))(triangles)  # a resume of the triangles on a model axis
    np.testing.assert_allclose(split.finalize(jax.device_get(columns)).result, gram.result, rtol=1e-5, atol=1e-4)


def test_groupby_config_and_the_key_and_weight_columns_of_a_parquet_file(tmp_path, monkeypatch):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    config = importlib.import_module("configs.groupby").get_config("quick")
    with monkeypatch.context() as patch:
        patch.setattr(launch_data, "ZipfKeys", None)  # num_keys is K of 'zipf:K': no keys are drawn for it
        assert make_combiner(config.combiner, config.data) == ss.GroupBy(ss.Moments(), 10)
    source = make_source(config.data)
    synthetic = source.read(0, 1000)[0]
    counts = np.bincount(synthetic, minlength=10)
    assert len(counts) == 10 and counts[0] > 2 * counts[9] > 0  # Zipf frequencies over keys 0..9
    np.testing.assert_array_equal(source.read(300, 700)[0], synthetic[300:700])  # the same keys however cut

    keys, x, w = data()
    frame = pd.DataFrame({"k": keys, "a": x[:, 0], "w": w, "b": x[:, 1], "c": x[:, 2]})
    frame.to_parquet(tmp_path / "rows.parquet")
    config.data.update(kind="parquet", path=str(tmp_path / "rows.parquet"), key="k", weight="w")
    config.combiner.inner, config.combiner.kwargs.num_keys = {"name": "Sum", "kwargs": {}}, K
    got = ss.run(make_combiner(config.combiner, config.data), make_source(config.data), **RUN).to_pandas()
    want = frame[["a", "b", "c"]].mul(frame.w, axis=0).groupby(frame.k).sum().stack()
    np.testing.assert_allclose(got["sum"], want, rtol=1e-5, atol=1e-5)
    assert got.index.tolist() == want.index.tolist()  # (key, column name)
    config.combiner = {"name": "Sum", "kwargs": {}}
    assert_usage_error(lambda: make_combiner(config.combiner, config.data), ["config.data.key='k'", "GroupBy"])


@pytest.mark.parametrize("dtype, mesh", [(np.float64, "data:1"), (np.float32, "data:3"), (np.float64, "data:8")])
def test_groupby_moments_is_pandas_groupby_on_1_3_and_8_devices(dtype, mesh):
    pd = pytest.importorskip("pandas")
    rows = 2999  # ragged on every split
    keys = launch_data.ZipfKeys(rows, 40, seed=3).read(0, rows)
    x = np.random.default_rng(3).normal(5, 2, size=(rows, 2)).astype(dtype)
    got = ss.run(ss.GroupBy(ss.Moments(), 40), (keys, x), mesh=mesh, **RUN)
    frame = pd.DataFrame(x.astype(np.float64)).groupby(keys)
    present = np.unique(keys)
    rtol = 1e-12 if dtype == np.float64 else 1e-6
    np.testing.assert_array_equal(got.rows[present], frame.size())
    np.testing.assert_allclose(got.mean[present], frame.mean(), rtol=rtol)
    np.testing.assert_allclose(got.var[present], frame.var(ddof=0), rtol=max(rtol, 1e-9 if dtype == np.float64 else 0))
    np.testing.assert_array_equal(got.min[present], frame.min().astype(dtype))
    np.testing.assert_array_equal(got.max[present], frame.max().astype(dtype))
    absent = np.setdiff1d(np.arange(40), present)
    assert np.isnan(got.mean[absent]).all() and (got.rows[absent] == 0).all()


def test_groupby_and_weighted_moments_count_the_nans_omit_skips_like_pandas():
    # One device: its programs compile in about two thirds of eight's; GroupBy(Moments) and Weighted(Moments) under
    # nan_policy="omit" merged over 8 devices: test_nan_omit, test_correlation_and_forms.
    pd = pytest.importorskip("pandas")
    keys, x, w = data(997)
    x = x.astype(np.float64)
    x[::7, 0] = np.nan
    x[3::11, 2] = np.nan
    frame = pd.DataFrame(x)
    g = ss.run(ss.GroupBy(ss.Moments(), K), (keys, x), nan_policy="omit", mesh="data:1", **RUN)
    np.testing.assert_array_equal(g.nan_count, frame.isna().groupby(keys).sum().reindex(range(K), fill_value=0))
    np.testing.assert_array_equal(g.rows, np.bincount(keys, minlength=K))  # a NaN skips its value, not its row
    np.testing.assert_array_equal(g.count[2], frame[keys == 2].count())  # each column its own count
    np.testing.assert_allclose(g.mean[2], frame[keys == 2].mean(), rtol=1e-12)
    # Without zeros (nor extremes) the per-key fold counts NaNs and adds the counts only in a branch taken where a kept
    # row holds one (propagate: the key's sum turns NaN) or a row seen was not kept (omit; key 4: a column all NaN)
    y = x.copy()
    y[keys == 4, 1] = np.nan
    present = np.unique(keys)
    for policy, mean in (("propagate", np.mean), ("omit", np.nanmean)):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            few = ss.run(ss.GroupBy(ss.Moments(fields="mean,nan_count"), K), (keys, y), nan_policy=policy,
                         mesh="data:1", **RUN)
        assert any("Moments of no rows" in str(w.message) for w in said) == (policy == "omit")  # key 4's column
        np.testing.assert_array_equal(few.nan_count, pd.DataFrame(y).isna().groupby(keys).sum().reindex(range(K),
                                                                                                          fill_value=0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # nanmean of key 4's all-NaN column
            want = np.stack([mean(y[keys == k], axis=0) for k in present])
        np.testing.assert_allclose(few.mean[present], want, rtol=1e-12)
    r = ss.run(ss.Weighted(ss.Moments()), (w, x), nan_policy="omit", mesh="data:1", **RUN)
    np.testing.assert_array_equal(r.nan_count, np.isnan(x[w > 0]).sum(0))  # a zero weight omits its row
    for j in (0, 2):
        kept = ~np.isnan(x[:, j])
        np.testing.assert_allclose(r.mean[j], np.average(x[kept, j], weights=w[kept]), rtol=1e-12)


ROWS, KEYS = 2999, 40  # the shapes of test_groupby_moments_is_pandas_groupby_on_1_3_and_8_devices: its programs


def key_codes(rows=ROWS, seed=5):
    """Codes 0..39, the last only in the last 7 rows, and rows whose key is missing (none of those 7)."""
    codes = np.random.default_rng(seed).integers(0, KEYS - 1, rows)
    codes[-7:] = KEYS - 1
    missing = np.zeros(rows, bool)
    missing[:-7:97] = True
    return codes, missing


def keys_by_value(rows=ROWS, seed=5):
    """Key codes 0..39 (key 39 only in the last 7 rows: at 8 devices the last device's alone) with missing keys,
    and the same grouping written as strings, a categorical (an unobserved category too), nullable int64 ids and
    uint64 ids, each list sorted as pandas sorts it, so that code c is its c-th key."""
    pd = pytest.importorskip("pandas")
    codes, missing = key_codes(rows, seed)
    strings = np.array(["", *[f"k{i:02d}" for i in range(KEYS - 3)], "zz", "ü"], dtype=object)[codes]
    strings[missing] = None
    categories = [f"c{i:02d}" for i in range(KEYS + 1)][::-1]  # pandas' order: the categories', here not sorted
    category = pd.Categorical.from_codes(np.where(missing, -1, codes + (codes >= 3)), categories)  # c37 unobserved
    int64 = np.iinfo(np.int64)
    ids = np.array([int64.min, *(np.arange(4 - KEYS, 0) * 10**12), 10**12, 10**12 + 1, int64.max])[codes]
    nullable = pd.array(ids, dtype="Int64")
    nullable[missing] = pd.NA
    unsigned = np.array([*range(KEYS - 3), 2**63, 2**64 - 2, 2**64 - 1], dtype=np.uint64)[codes]
    return {"strings": strings, "categorical": category, "int64": nullable, "uint64": unsigned}


def assert_pandas_groupby(got, keys, x):
    """``got`` (a GroupBy(Moments) result) is pandas' groupby of ``x`` by ``keys``: its keys, rows and moments."""
    pd = pytest.importorskip("pandas")
    groups = pd.DataFrame(x).groupby(pd.Series(keys))
    assert got.keys.tolist() == groups.size().index.tolist()
    assert got.to_pandas().index.get_level_values(0).unique().tolist() == got.keys.tolist()
    np.testing.assert_array_equal(got.rows, groups.size())
    np.testing.assert_allclose(got.mean, groups.mean(), rtol=1e-12)
    np.testing.assert_allclose(got.var, groups.var(ddof=0), rtol=1e-9)
    np.testing.assert_array_equal(got.min, groups.min())
    np.testing.assert_array_equal(got.max, groups.max())


def test_groupby_by_value_of_strings_categoricals_int64_and_uint64_ids_is_pandas_groupby_on_8_and_1_devices():
    """Keys of any type, grouped as pandas groups them (sorted its way, missing keys dropped, unobserved
    categories absent, a key met by one device only), with their values in the result; one compiled program."""
    pd = pytest.importorskip("pandas")
    x = np.random.default_rng(6).normal(3, 2, size=(ROWS, 2))
    for kind, keys in keys_by_value().items():
        got = ss.run(ss.GroupBy(ss.Moments(), max_keys=KEYS), (keys, x), **RUN)
        assert_pandas_groupby(got, keys, x)
        assert got.keys.dtype == {"strings": object, "categorical": object, "int64": np.int64,
                                  "uint64": np.uint64}[kind], kind
    assert got.keys[-1] == 2**64 - 1 and got.rows[-1] == 7 and np.all(got.for_key(2**63).count == got.rows[-3])
    strings = keys_by_value()["strings"]
    one = ss.run(ss.GroupBy(ss.Moments()), (pd.Series(strings, name="city"), x), mesh="data:1", **RUN)
    assert_pandas_groupby(one, strings, x)
    assert one.keys[[0, 1, -2, -1]].tolist() == ["", "k00", "zz", "ü"] and one.to_pandas().index.names == ["city", None]
    assert np.all(one.for_key("ü").count == 7) and type(one.keys[1]) is str
    # in memory: the keys pandas.factorize reads (bools, narrow ints, Arrow strings, lists), without a run
    from sharded_scan.group_keys import memory_keys
    pa = pytest.importorskip("pyarrow")
    for keys, values in [(np.array([True, False, True]), [False, True]), (np.array([3, -128, 3], np.int8), [-128, 3]),
                         (pa.array(["b", None, "a"]), ["a", "b"]), (["b", "a", "b"], ["a", "b"])]:
        slots, found = memory_keys(keys, 10)
        assert found.tolist() == values and slots.dtype == np.int32
        assert [None if s < 0 else values[s] for s in slots] == [None if k is None else k for k in list(keys.tolist()
                                                                  if hasattr(keys, "tolist") else keys)]


@pytest.mark.filterwarnings("error::sharded_scan.errors.ColumnsLeftOut")  # by= is no column left out
def test_groupby_by_a_column_of_a_dataframe_parquet_csv_and_the_cli_key_resumes_exactly(tmp_path):
    """by="city" of a pandas and a polars DataFrame, a Parquet and a CSV source, and --config.data.key=city through
    the launcher (no factorize, no num_keys), each pandas' groupby("city"); a run stopped after 2 steps resumes."""
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    from launch.main import run_job

    x = np.random.default_rng(7).normal(size=(ROWS, 2))
    city = np.array([f"Zürich {i}" for i in range(KEYS)], dtype=object)[key_codes()[0]]
    frame = pd.DataFrame({"a": x[:, 0], "city": city, "b": x[:, 1]})
    frame.to_parquet(tmp_path / "rows.parquet")
    frame.to_csv(tmp_path / "rows.csv", index=False)
    job = ss.GroupBy(ss.Moments(), by="city")
    files = ss.sources.ParquetSource(tmp_path / "rows.parquet"), ss.sources.CsvSource(tmp_path / "rows.csv")
    polars = [pytest.importorskip("polars").from_pandas(frame)] if importlib.util.find_spec("polars") else []
    for data in (frame, *polars, *files):
        got = ss.run(job, data, **RUN)
        assert_pandas_groupby(got, city, x)
        assert got.by == "city" and got.columns.tolist() == ["a", "b"]
    pd.testing.assert_frame_equal(got.to_pandas()["mean"].unstack(), frame.groupby("city")[["a", "b"]].mean(),
                                  check_names=False, rtol=1e-12)  # indexed by the cities, as pandas' own

    class StopError(Exception):
        pass

    def stop_at_2(progress):
        if progress.step == 2:
            raise StopError

    options = ss.CheckpointOptions(str(tmp_path / "ckpt"), every_steps=1)
    with pytest.raises(StopError):
        ss.run(job, ss.sources.CsvSource(tmp_path / "rows.csv"), checkpoint=options, progress=stop_at_2, **RUN)
    resumed, report = ss.run_with_report(job, ss.sources.CsvSource(tmp_path / "rows.csv"), checkpoint=options, **RUN)
    assert report.resumed_from_step and report.rows_this_run < ROWS
    assert_pandas_groupby(resumed, city, x)

    config = importlib.import_module("configs.groupby").get_config("quick")
    config.data.update(kind="parquet", path=str(tmp_path / "rows.parquet"), key="city")
    config.microbatch = RUN["microbatch"]
    got, _ = run_job(config, str(tmp_path / "cli"))
    assert_pandas_groupby(got, city, x)
    assert ss.workdir.load_result(str(tmp_path / "cli"))["keys"].tolist() == sorted(set(city))


def test_file_key_columns_with_nulls_and_categories_read_once_are_pandas_groupby(tmp_path, monkeypatch):
    """A Parquet or CSV key column's nulls (strings, int64 at its limits) are missing keys, their rows dropped as
    pandas' groupby(dropna=True); a categorical (a dictionary column) groups in its categories' order, as pandas'
    groupby does; the key column is read once (a string column's ids and strings together), the file is not
    opened or counted again, and columns=None names the columns it leaves out but by."""
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    from sharded_scan.errors import ColumnsLeftOut
    from sharded_scan.sources import tabular

    i64 = np.iinfo(np.int64)
    words = ["Oslo", None, "Köln", "Oslo", "Århus", None, "Köln", "Oslo", "Oslo"]
    frame = pd.DataFrame({
        "city": pd.Categorical(words, categories=["Oslo", "Århus", "Köln", "Bern"]),  # Bern: no row
        "text": pd.Series(words, dtype=object),
        "id": pd.array([i64.max, 3, None, i64.min, 3, None, i64.max, 7, 1 - 2**63], "Int64"),
        "x": np.arange(9.0)})
    frame.to_parquet(tmp_path / "k.parquet")
    frame.to_csv(tmp_path / "k.csv", index=False)
    built = {"ParquetSource": 0, "CsvSource": 0, "_counted": 0}
    for name in ("ParquetSource", "CsvSource"):
        init = getattr(tabular, name).__init__
        monkeypatch.setattr(getattr(tabular, name), "__init__",
                            lambda self, *a, _init=init, _name=name, **k: built.update({_name: built[_name] + 1})
                            or _init(self, *a, **k))
        monkeypatch.setattr(getattr(tabular, name), "strings", None)  # the keys' strings come with their ids
    counted = tabular.CsvSource._counted
    monkeypatch.setattr(tabular.CsvSource, "_counted", lambda self: built.update(_counted=built["_counted"] + 1)
                        or counted(self))
    for path, by in [("k.parquet", "city"), ("k.parquet", "text"), ("k.parquet", "id"), ("k.csv", "id")]:
        source = (ss.sources.ParquetSource if path.endswith("parquet") else ss.sources.CsvSource)(
            tmp_path / path, columns=["x"])
        got = ss.run(ss.GroupBy(ss.Sum(), by=by), source, **RUN)
        want = frame.groupby(by, observed=True)["x"]  # dropna=True
        assert got.keys.tolist() == want.sum().index.tolist(), (path, by)
        np.testing.assert_array_equal(np.ravel(got.sum), want.sum())
        np.testing.assert_array_equal(got.rows, want.size())
    assert built == {"ParquetSource": 3, "CsvSource": 1, "_counted": 1}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        keys, rest = ss.sources.ParquetSource(tmp_path / "k.parquet").grouped_by("city").parts
    assert [(w.category, w.message.columns) for w in seen] == [(ColumnsLeftOut, ["text"])]  # city is the keys
    assert (keys.column_names, rest.column_names) == ("city", ["id", "x"])


def test_more_keys_than_the_bound_and_bad_keys_are_one_line_before_compute(tmp_path, monkeypatch):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    keys = keys_by_value(rows=300)
    x = np.ones((300, 1))
    assert_usage_error(lambda: ss.run(ss.GroupBy(ss.Sum(), max_keys=4), (keys["strings"], x)),
                       ["distinct values, more than max_keys=4", "max_keys=N"])
    pd.DataFrame({"k": keys["uint64"], "x": x[:, 0]}).to_parquet(tmp_path / "k.parquet")
    rows = ss.sources.ParquetSource(tmp_path / "k.parquet")
    monkeypatch.setattr("sharded_scan.group_keys.CHUNK_ROWS", 100)  # a file's keys are read a chunk at a time
    assert_usage_error(lambda: ss.run(ss.GroupBy(ss.Sum(), by="k", max_keys=3), rows),
                       ["at least (by row 100 of 300) ", "distinct values, more than max_keys=3"])
    assert_usage_error(lambda: ss.run(ss.GroupBy(ss.Sum(), by="nope"), rows), ["no column 'nope'", "k, x"])
    frame = pd.DataFrame({"k": keys["strings"], "x": x[:, 0]})
    assert_usage_error(lambda: ss.run(ss.GroupBy(ss.Sum(), by="nope"), frame), ["by='nope'", "'k', 'x'"])
    assert_usage_error(lambda: ss.GroupBy(ss.Sum(), 3, max_keys=3), ["not both"])
    assert_usage_error(lambda: ss.GroupBy(ss.Sum(), out_of_range="other"), ["dense keys"])
    assert_usage_error(lambda: ss.run(ss.GroupBy(ss.Sum()), ([None, np.nan, None], np.ones((3, 1)))),
                       ["every GroupBy key is missing", "dropna"])
    assert_usage_error(lambda: ss.run(ss.GroupBy(ss.Sum(), 3), (keys["strings"], x)),
                       ["GroupBy(num_keys=3) keys must be integers 0..2", "leave num_keys out"])



def test_groupby_sum_finalizes_every_key_in_one_call_as_key_by_key():
    """``Sum.finalizes_stacked``: GroupBy finalizes its keys in one call, not one a key; the result is the
    key-by-key one, field for field and dtype for dtype: float and exact integer sums (past int64 too:
    Python ints), keys of no rows, the ``other`` row, keys by value."""

    class KeyByKey(ss.Sum):
        finalizes_stacked = False

    spec = (jax.ShapeDtypeStruct((), np.int32), (jax.ShapeDtypeStruct((3,), np.float32),
                                                 jax.ShapeDtypeStruct((), np.int32)))
    r = np.random.default_rng(0)
    by_value = ss.GroupBy(ss.Sum(), max_keys=10).with_keys(np.array(list("abcdefg"), object), "city")
    for big, combiner in [(False, ss.GroupBy(ss.Sum(), K, out_of_range="other")), (True, by_value)]:
        acc = jax.tree.map(np.array, combiner.init(spec))  # then states as a run leaves them
        (floats, ints), count = acc.value.sum, acc.value.count
        floats[:] = r.normal(size=floats.shape)
        ints.limbs[:] = r.integers(0, 1 << 16, ints.limbs.shape)
        ints.limbs[..., -1] = r.integers(-5, 5, ints.limbs.shape[:-1]) * (1 << 14 if big else 1)
        count.limbs[:] = 0
        count.limbs[:, 0] = r.integers(0, 3, count.limbs.shape[0])  # some keys of no rows
        acc.count.limbs[: len(count.limbs), 0] = count.limbs[:, 0]
        one, each = combiner.finalize(acc), combiner.rewrap(KeyByKey()).finalize(acc)
        assert ss.Sum.finalizes_stacked and type(one) is type(each) and type(one.result) is type(each.result)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(each), strict=True):
            assert np.asarray(a).dtype == np.asarray(b).dtype
            np.testing.assert_array_equal(a, b)
        assert (np.asarray(one.sum[1]).dtype == object) == big  # past int64: Python ints, as key by key
        assert one.by == each.by == combiner.key_name and one.keys.tolist() == each.keys.tolist()


def test_groupby_moments_finalizes_every_key_at_once_as_each_keys_moments_and_pandas(monkeypatch):
    """``Moments.finalizes_stacked``: GroupBy(Moments()) finalizes its keys in one call; each key's result is, bit
    for bit and dtype for dtype, the key-by-key one (``Moments().finalize`` of that key's state, keys of no rows
    as before), and pandas' groupby in float64 (mean, var, min, max, skew, kurt), under both nan_policy values,
    with keys of no rows, a constant key, a key's column of NaNs only and NaNs here and there."""
    pd = pytest.importorskip("pandas")
    states, finalize = [], ss.GroupBy.finalize
    monkeypatch.setattr(ss.GroupBy, "finalize", lambda self, acc: states.append((self, acc)) or finalize(self, acc))
    assert ss.Moments().finalizes_stacked
    # the shapes of test_groupby_moments_is_pandas_groupby_on_1_3_and_8_devices and of
    # test_groupby_and_weighted_moments_count_the_nans_omit_skips_like_pandas: their programs
    cases = [("propagate", 40, launch_data.ZipfKeys(2999, 40, seed=3).read(0, 2999),
              np.random.default_rng(3).normal(5, 2, size=(2999, 2)), {"mesh": "data:1"}),
             ("omit", K, *(v.astype(t) for v, t in zip(data(997)[:2], (np.int32, np.float64), strict=True)),
              {"mesh": "data:1"})]
    for policy, num_keys, keys, x, mesh in cases:
        keys = np.where(keys >= num_keys - 2, 0, keys).astype(keys.dtype)  # the last 2 keys of no rows
        x[::13, 0] = np.nan
        x[keys == 1] = 7.25  # a constant key
        x[keys == 2, 1] = np.nan  # its column has no value to omit
        absent = np.setdiff1d(np.arange(num_keys), keys)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            got = ss.run(ss.GroupBy(ss.Moments(), num_keys), (keys, x), nan_policy=policy, **mesh, **RUN)
        # keys of no rows are quiet; under "omit" key 2's column of NaNs alone says it has no value
        assert sum("Moments of no rows" in str(w.message) for w in said) == (policy == "omit")
        combiner, acc = states[-1]
        assert combiner.inner.finalizes_stacked  # Moments; under "omit" FiniteMoments (a count per column)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            one = finalize(combiner, acc)
            with monkeypatch.context() as m:
                m.setattr(ss.Moments, "finalizes_stacked", False)
                each = finalize(combiner, acc)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(each), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        skip = policy == "omit"
        groups = pd.DataFrame(x).groupby(keys)
        n = np.broadcast_to(got.count.reshape(num_keys, -1), got.mean.shape).astype(np.float64)
        present = np.unique(keys)
        with np.errstate(divide="ignore", invalid="ignore"):
            # pandas' skew and kurt are the bias-corrected forms of the biased ones (scipy's defaults) here
            skew = got.skewness * np.sqrt(n * (n - 1)) / (n - 2)
            kurt = ((n + 1) * got.kurtosis + 6) * (n - 1) / ((n - 2) * (n - 3))
        want = {"mean": (got.mean, groups.mean(skipna=skip)), "var": (got.var, groups.var(ddof=0, skipna=skip)),
                "min": (got.min, groups.min(skipna=skip)), "max": (got.max, groups.max(skipna=skip))}
        for name, (ours, theirs) in want.items():
            np.testing.assert_allclose(ours[present], theirs, rtol=1e-12, atol=1e-12, err_msg=name)
        for ours, theirs in ((skew, groups.skew(skipna=skip)), (kurt, groups.kurt(skipna=skip))):
            theirs, ours = theirs.to_numpy(), ours[present]
            both = np.isfinite(theirs) & (n[present] > 3)
            np.testing.assert_allclose(ours[both], theirs[both], rtol=1e-9)
            assert np.isnan(ours[1]).all()  # the constant key: no shape, as scipy's
        assert np.isnan(got.mean[absent]).all() and (got.rows[absent] == 0).all() and (got.count[absent] == 0).all()
        assert (got.var[1] == 0).all() and np.isnan(got.mean[2, 1])
        assert (got.nan_count[2, 1] == (keys == 2).sum()) and got.min.dtype == np.float64


def _eqns(jaxpr):
    """The equations of ``jaxpr`` with those of its nested ``jit`` calls and of the CPU's branch where it chooses by
    platform (``jax.lax.platform_dependent``: ``keyed_sums.keyed_sum``), not of its other branches and loops."""
    for e in jaxpr.eqns:
        if e.primitive.name in ("jit", "pjit"):
            yield from _eqns(e.params["jaxpr"].jaxpr)
        elif e.primitive.name == "cond" and e.params.get("branches_platforms"):
            yield from _eqns(cpu_branch(e).jaxpr)
        else:
            yield e


def test_groupby_moments_fold_scatters_each_kept_row_once_a_value_and_masks_no_values():
    # issue 45 (the group-by moments row): a micro-batch of the peers' fields scatters each row's deviation and
    # square, min and max, and two counts (GroupBy's, the fold's), 14 values a row of 3 columns (main: 18: the
    # NaNs of every row, the first row of each key); the rows not kept go to no key (an index past the last)
    # instead of a select of each value (main: 5 of them, (rows, 3)); NaNs and fresh keys' first rows in branches
    combiner = ss.GroupBy(ss.Moments(fields=("mean", "var", "min", "max")), num_keys=K)
    spec = (jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((3,), jnp.float32))
    acc = jax.eval_shape(lambda: combiner.init(spec))
    rows = (jax.ShapeDtypeStruct((64,), jnp.int32), jax.ShapeDtypeStruct((64, 3), jnp.float32))
    eqns = list(_eqns(jax.make_jaxpr(combiner.add)(acc, rows, jax.ShapeDtypeStruct((64,), bool)).jaxpr))
    scattered = [e.invars[2].aval.shape for e in eqns if e.primitive.name.startswith("scatter")]
    assert sum(int(np.prod(s[1:])) for s in scattered) == 14, scattered
    assert not [e for e in eqns if e.primitive.name == "select_n" and e.outvars[0].aval.shape == (64, 3)]
