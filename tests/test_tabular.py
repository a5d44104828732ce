"""Parquet, Arrow, CSV and DataFrame sources against pandas/numpy in float64."""

import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.sources import ALIGN, CsvSource, ParquetSource, dataframe_source
from tests.helpers import assert_usage_error, rel_err

pd = pytest.importorskip("pandas")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N = 1013  # ragged against every step and row group


@pytest.fixture(scope="module")
def frame():
    rng = np.random.default_rng(0)
    df = pd.DataFrame({
        "year": rng.integers(1990, 2021, N),
        "income": rng.lognormal(10.8, 0.5, N),
        "age": rng.normal(40, 10, N),
        "name": [f"p{i}" for i in range(N)],
        "member": rng.random(N) < 0.3,
    })
    df["price"] = 250 * df.year + 0.8 * df.income - 30 * df.age + rng.normal(0, 50, N)
    return df


@pytest.fixture(scope="module")
def files(frame, tmp_path_factory):
    where = tmp_path_factory.mktemp("tabular")
    table = pa.Table.from_pandas(frame, preserve_index=False)
    pq.write_table(table, where / "one.parquet", row_group_size=97)
    (where / "parts").mkdir()
    for i, start in enumerate(range(0, N, 400)):  # a directory of files, 3 row groups and 1 file each
        pq.write_table(table.slice(start, 400), where / "parts" / f"part-{i}.parquet", row_group_size=150)
    import pyarrow.feather as feather

    feather.write_feather(table, where / "all.arrow")
    frame.to_csv(where / "all.csv", index=False)
    return where


X, Y = ["year", "income", "age"], "price"
JOB = {"mesh": "data:2", "microbatch": 64, "steps_per_call": 1}  # where a case's layout is not its point: one, shared


@pytest.mark.parametrize("kind", ["parquet", "directory", "glob", "feather", "csv"])
def test_every_kind_reads_the_rows_pandas_has_for_any_range(frame, files, kind):
    make = {
        "parquet": lambda **kw: ParquetSource(files / "one.parquet", **kw),
        "directory": lambda **kw: ParquetSource(files / "parts", **kw),
        "glob": lambda **kw: ParquetSource(str(files / "parts" / "part-*.parquet"), **kw),
        "feather": lambda **kw: ParquetSource(files / "all.arrow", format="feather", **kw),
        "csv": lambda **kw: CsvSource(files / "all.csv", **kw),
    }[kind]
    source = make(columns=(X, Y))
    assert source.num_rows == N
    assert [s.dtype for s in source.spec] == [np.float64, np.float64]
    want_x, want_y = frame[X].to_numpy(np.float64), frame[Y].to_numpy(np.float64)
    for start, stop in [(0, 5), (5, 96), (96, 400), (400, 401), (401, N)]:
        x, y = source.read(start, stop)
        np.testing.assert_array_equal(x, want_x[start:stop])
        np.testing.assert_array_equal(y, want_y[start:stop])
    fresh = make(columns="member", dtype="int32")
    np.testing.assert_array_equal(fresh.read(0, N), frame["member"].to_numpy(np.int32))


def test_parquet_reads_in_any_order_and_blocks_give_the_same_rows(frame, files, monkeypatch):
    """One scan serves consecutive reads: reads back, skips within a row group (97 rows), across
    several, and ending on a group's boundary get the rows too; so do casts in small row blocks."""
    monkeypatch.setattr(ss.sources.tabular, "FILL_BLOCK_ROWS", 7)
    source = ParquetSource(files / "one.parquet", columns=(X, Y))
    want_x, want_y = frame[X].to_numpy(np.float64), frame[Y].to_numpy(np.float64)
    for start, stop in [(0, 97), (97, 150), (160, 170), (150, 160), (500, 700), (3, 4), (990, N), (0, N)]:
        x, y = source.read(start, stop)
        np.testing.assert_array_equal(x, want_x[start:stop])
        np.testing.assert_array_equal(y, want_y[start:stop])


def test_columns_read_as_they_are_come_as_arrows_rows_in_the_order_named(frame, files, tmp_path):
    """Columns of the row dtype, no cast: a read inside one row group (97 rows) is Arrow's row-major copy;
    the rows, their column order, a read across groups, a padded one and a group with nulls are the same."""
    for columns in (["income", "age"], ["year"]):
        source = ParquetSource(files / "one.parquet", columns=columns)
        want = frame[columns].to_numpy()
        for start, stop in [(0, 97), (100, 150), (150, 160), (90, 300), (990, N)]:
            rows = source.read(start, stop)
            np.testing.assert_array_equal(rows, want[start:stop])
            assert rows.dtype == want.dtype and rows.ctypes.data % ALIGN == 0
        padded = np.concatenate([want[200:250], np.zeros((14, len(columns)))])
        np.testing.assert_array_equal(source.read(200, 250, pad_to=64), padded)
    values = np.arange(20, dtype=np.float32)
    b = pa.array([None if i == 13 else float(i) for i in range(20)], pa.float32())
    pq.write_table(pa.table({"a": values, "b": b}), tmp_path / "nulls.parquet", row_group_size=10)
    rows = ParquetSource(tmp_path / "nulls.parquet", columns=["b", "a"]).read(0, 20)
    np.testing.assert_array_equal(rows, np.stack([np.where(values == 13, np.nan, values), values], axis=1))


@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_the_last_steps_read_is_the_rows_then_zeros_in_aligned_arrays(frame, files, kind):
    source = (ParquetSource(files / "one.parquet", columns=(X, Y)) if kind == "parquet"
              else CsvSource(files / "all.csv", columns=(X, Y)))
    source.read(0, 900)  # a CSV reads forward: it is then at row 900
    x, y = source.read(900, N, pad_to=128)  # 113 rows across two row groups, then 15 zero rows
    want_x, want_y = frame[X].to_numpy(np.float64)[900:], frame[Y].to_numpy(np.float64)[900:]
    np.testing.assert_array_equal(x, np.concatenate([want_x, np.zeros((15, 3))]))
    np.testing.assert_array_equal(y, np.concatenate([want_y, np.zeros(15)]))
    assert x.ctypes.data % ALIGN == 0 and y.ctypes.data % ALIGN == 0  # placed on CPU devices without a copy


def test_a_covariance_of_parquet_columns_matches_pandas(frame, files):
    # Over two devices, ragged, its steps (128 rows) across files (400) and row groups (150); the engine over one and
    # eight devices is each source kind's in test_sources. The program is the CSV job's and the names' below.
    source = ParquetSource(files / "parts", columns=[*X, Y], dtype="float32")
    got = ss.run(ss.Covariance(), source, **JOB)
    want = frame[[*X, Y]].astype("float32").astype("float64").cov().to_numpy()
    assert rel_err(got.cov, want) < 1e-5


def test_a_dataframe_is_data_and_nullable_columns_become_nan(frame):
    got = ss.run(ss.Moments(), frame[X].astype("float32"), nan_policy="omit", **JOB)  # the polars frame's program
    assert rel_err(got.mean, frame[X].to_numpy(np.float64).mean(0)) < 1e-6
    nullable = pd.DataFrame({"a": pd.array([1, None, 3, 4], dtype="Int64"), "b": [1.0, 2.0, None, 4.0]})
    rows = dataframe_source(nullable, dtype="float32").read(0, 4)
    np.testing.assert_array_equal(np.isnan(rows), [[False, False], [True, False], [False, True], [False, False]])
    omitted = ss.run(ss.Sum(), dataframe_source(nullable, dtype="float32"), nan_policy="omit")
    assert int(omitted.count) == 4 and list(omitted.sum) == [8.0, 7.0]  # pandas' sum(): each NaN skipped alone
    assert_usage_error(lambda: dataframe_source(nullable, dtype="int32").read(0, 4), ["'a'", "nulls", "float32"])


def test_a_csv_job_resumes_exactly_once_after_a_crash(frame, files, tmp_path):
    class Stop(Exception):  # noqa: N818 - a stand-in for a kill
        pass

    def stop_after_two(p):
        if p.step >= 2:
            raise Stop

    options = dict(JOB, checkpoint=ss.CheckpointOptions(str(tmp_path), 1))
    columns = [*X, Y]  # the parquet covariance's program
    want = ss.run(ss.Covariance(), CsvSource(files / "all.csv", columns=columns, dtype="float32"), **JOB)
    with pytest.raises(Stop):
        ss.run(ss.Covariance(), CsvSource(files / "all.csv", columns=columns, dtype="float32"),
               progress=stop_after_two, **options)
    got, report = ss.run_with_report(ss.Covariance(), CsvSource(files / "all.csv", columns=columns, dtype="float32"),
                                     **options)
    assert report.resumed_from_cursor == 128
    np.testing.assert_array_equal(got.cov, want.cov)


def test_results_with_columns_keep_the_column_names(frame, files):
    x = frame[X].astype("float32")
    assert ss.run(ss.Covariance(), frame[[*X, Y]].astype("float32"), **JOB).columns.tolist() == [*X, Y]
    sales = ParquetSource(files / "one.parquet", columns=(None, Y), dtype="float32")
    fit = ss.run(ss.LinearRegression(solver="comoments"), sales, mesh="data:2")  # a cheap compile
    assert fit.columns.tolist() == ["year", "income", "age", "member"]  # every numeric column but y, in file order
    unnamed = ss.run(ss.Moments(), x.to_numpy(), nan_policy="omit", **JOB).columns  # positions, like pandas
    np.testing.assert_array_equal(unnamed, np.arange(3))


def test_a_polars_frame_is_data_with_nulls_as_nan_and_its_column_names(frame):
    pl = pytest.importorskip("polars")
    x = pl.from_pandas(frame[X]).with_columns(pl.when(pl.col("age") > 55).then(None).otherwise(pl.col("age"))
                                             .alias("age")).cast(pl.Float32)
    got = ss.run(ss.Moments(), x, nan_policy="omit", **JOB)  # a null (NaN) skipped where it stands
    want = frame[X].astype("float32").astype("float64")
    want.loc[frame.age > 55, "age"] = np.nan
    np.testing.assert_allclose(got.mean, want.mean(), rtol=1e-6)
    assert got.count.tolist() == want.count().tolist() and got.columns.tolist() == X


def test_string_columns_are_counted_like_pandas_and_topk_lists_the_strings(frame, files):
    names = np.random.default_rng(1).choice(["Lyon", "Köln", "Oslo", "Porto"], N, p=[0.4, 0.3, 0.2, 0.1])
    cities = pd.DataFrame({"city": names, "kind": pd.Categorical(names)})
    top = ss.run(ss.TopK(k=5), dataframe_source(cities, columns=["city", "kind"]), mesh="data:2")  # no opt-in
    want = cities.city.value_counts()
    np.testing.assert_array_equal(top.values, np.stack([[*want.index, ""]] * 2))  # categorical: the same strings
    np.testing.assert_array_equal(top.counts, np.stack([[*want.to_numpy(), 0]] * 2))
    assert top.columns.tolist() == ["city", "kind"]
    # both columns, as above: the same compiled programs (TopK's k is its finalize's only)
    hashed = ss.run(ss.TopK(k=4), dataframe_source(cities, strings="hash", columns=["city", "kind"]), mesh="data:2")
    np.testing.assert_array_equal(hashed.values, np.stack([want.index] * 2))
    distinct = ss.run(ss.DistinctCount(exact_up_to=2048), ParquetSource(files / "one.parquet", columns=["name"]),
                      mesh="data:2")
    assert distinct.count.tolist() == [frame.name.nunique()] and distinct.exact.all()
    assert_usage_error(lambda: ss.run(ss.Moments(), dataframe_source(cities, columns=["city"])),
                       ["'city'", "not as numbers", "TopK", "Moments", "columns="])
    assert_usage_error(lambda: dataframe_source(cities, columns=["city"], strings="refuse"), ["'city'", "not a number"])
    assert_usage_error(lambda: ParquetSource(files / "one.parquet", columns=["name", "age"], strings="hash"),
                       ["int64 ids", "only string columns"])
    assert_usage_error(lambda: CsvSource(files / "all.csv", columns=["name"], strings="yes"), ["strings must be"])


def test_bad_columns_are_one_line(files):
    one = files / "one.parquet"
    assert_usage_error(lambda: ParquetSource(one, columns=["name"], strings="refuse"),
                       ["'name'", "not a number", "year"])
    assert_usage_error(lambda: ParquetSource(one, columns=["weight"]), ["no column 'weight'", "price"])
    assert_usage_error(lambda: ParquetSource(one, columns=[1, 2]), ["columns must be"])
    assert_usage_error(lambda: ParquetSource(files / "nope.parquet"), ["cannot read", "nope.parquet"])
    assert_usage_error(lambda: ParquetSource(str(files / "none-*.parquet")), ["no files match"])
    assert_usage_error(lambda: CsvSource(files / "nope.csv"), ["no such CSV file"])
    # doubles are no longer refused without jax_enable_x64: they are summed in float64
    want = pq.read_table(one, columns=X).to_pandas().to_numpy(np.float64).sum(0)
    total = ss.run(ss.Sum(), ParquetSource(one, columns=X))
    assert total.sum.dtype == np.float64 and rel_err(total.sum, want) < 1e-13


def test_files_that_disagree_nulls_in_integers_and_ragged_lines_are_one_line_before_any_read(tmp_path):
    (tmp_path / "parts").mkdir()
    first = pa.table({"a": pa.array([1, 2, None], pa.int32()), "b": [1.0, 2.0, 3.0]})
    pq.write_table(first, tmp_path / "parts" / "0.parquet")
    pq.write_table(pa.table({"a": pa.array([1.5, 2.5]), "b": [1.0, 2.0]}), tmp_path / "parts" / "1.parquet")
    pq.write_table(pa.table({"b": [1.0]}), tmp_path / "b_only.parquet")
    assert_usage_error(lambda: ParquetSource(tmp_path / "parts", columns=["a", "b"]),
                       ["'a'", "double", "1.parquet", "int32", "0.parquet", "schemas differ"])
    assert ParquetSource(tmp_path / "parts", columns=["b"]).num_rows == 5  # the columns they share
    both = [tmp_path / "parts" / "0.parquet", tmp_path / "b_only.parquet"]
    assert_usage_error(lambda: ParquetSource(both, columns=["a"]), ["b_only.parquet", "no column 'a'"])
    (tmp_path / "nulls.csv").write_text("a,b\n1,2\n,3\n4,5\n")
    for source, nulls in ((lambda dtype: ParquetSource(tmp_path / "parts" / "0.parquet", columns=["a"], dtype=dtype),
                           [False, False, True]),
                          (lambda dtype: CsvSource(tmp_path / "nulls.csv", columns=["a"], dtype=dtype),
                           [False, True, False])):
        assert_usage_error(lambda: source("int32"), ["'a'", "nulls", "int32", "dtype='float32'"])  # noqa: B023
        np.testing.assert_array_equal(np.isnan(source("float32").read(0, 3))[:, 0], nulls)
    (tmp_path / "ragged.csv").write_text("a,b\n1,2\n3\n4,5\n")
    assert_usage_error(lambda: CsvSource(tmp_path / "ragged.csv"), ["ragged.csv", "Expected 2 columns, got 1"])


def test_empty_vectors_and_column_names_read_as_one_are_one_line_naming_the_column_and_the_fix(tmp_path):
    """Issue 42, finding 14: empty lists, duplicate names and names that are one as text were tracebacks."""
    lists = pa.list_(pa.float32())
    pq.write_table(pa.table({"v": pa.array([[], [], []], lists), "a": [1.0, 2.0, 3.0]}), tmp_path / "empty.parquet")
    pq.write_table(pa.table({"v": pa.array([[], [1.0, 2.0], [3.0, 4.0]], lists)}), tmp_path / "first.parquet")
    pq.write_table(pa.table({"v": pa.array([[], []], pa.list_(pa.float32(), 0))}), tmp_path / "size0.parquet")
    empty_only = ["list column 'v'", "only empty lists", "no values a row", "leave 'v' out of columns="]
    assert_usage_error(lambda: ParquetSource(tmp_path / "empty.parquet"), empty_only)  # was: cannot reshape
    assert_usage_error(lambda: ParquetSource(tmp_path / "empty.parquet", columns=["v"]), empty_only)
    assert_usage_error(lambda: ParquetSource(tmp_path / "first.parquet", columns="v"),  # was: rows hold no values
                       ["'v'", "empty list at row 0", "row 1 holds 2 values", "nulls", "pad them to 2 values"])
    assert_usage_error(lambda: ParquetSource(tmp_path / "size0.parquet"), ["'v'", "no values a row", "out of columns="])
    assert_usage_error(lambda: dataframe_source(pd.DataFrame({"v": [np.zeros(0, np.float32)] * 3})), empty_only)
    twice = pd.DataFrame(np.ones((3, 2), np.float32), columns=["a", "a"])
    assert_usage_error(lambda: ss.run(ss.Sum(), twice), ["two columns named 'a'", "rename one"])  # was: ValueError
    one_text = pd.DataFrame(np.ones((3, 2), np.float32), columns=[1, "1"])
    assert_usage_error(lambda: ss.run(ss.Sum(), one_text), ["columns 1 and '1'", "one name as text", "rename one"])
    assert_usage_error(lambda: dataframe_source(one_text, columns=["1"]), ["columns 1 and '1'"])  # was: KeyError
