"""Polars and pyarrow as ParquetSource's decoder: the same rows, value for value and bit for bit, whichever
decodes (no JAX program: the reader is read directly)."""

import os
import signal

import numpy as np
import pytest

from sharded_scan.errors import UsageError
from sharded_scan.sources import CsvSource, ParquetSource, tabular

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("polars")

I64, U64 = np.iinfo(np.int64), np.iinfo(np.uint64)
ROWS = 1000  # row groups of 128 rows: 7 full and a ragged last one of 104


def edge_table():
    rng = np.random.default_rng(3)
    f64 = rng.normal(size=ROWS)
    f64[[0, 5, 900]] = [np.nan, np.inf, -0.0]
    f32 = rng.normal(size=ROWS).astype(np.float32)
    f32[[1, 999]] = [-np.inf, np.float32(1e-45)]
    ints = rng.integers(-5, 5, ROWS)
    ints[[2, 3]] = [I64.min, I64.max]
    big = rng.integers(0, 10, ROWS).astype(np.uint64)
    big[4] = U64.max
    nullable = rng.normal(size=ROWS)
    mask = np.zeros(ROWS, bool)
    mask[[7, 128, 129, 999]] = True  # nulls in several row groups, one in the ragged last
    words = np.array(["", "a\x00b", "ünï", "日本語", "x" * 40, "🙂"], object)[rng.integers(0, 6, ROWS)]
    return pa.table({
        "f64": f64, "f32": f32, "i64": ints, "u64": big, "i8": rng.integers(-128, 127, ROWS).astype(np.int8),
        "flag": rng.integers(0, 2, ROWS).astype(bool), "nan_or_null": pa.array(nullable, mask=mask),
        "int_null": pa.array(ints, mask=mask), "text": pa.array(words, pa.string()),
        "big_text": pa.array(words, pa.large_string()),
    })


def same_rows(a, b):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()  # bitwise: NaN payloads, -0.0, subnormals


@pytest.mark.parametrize("columns, dtype", [
    (["f64", "f32", "nan_or_null", "flag", "i8"], None),  # float64, nulls as NaN
    (["f32", "i8", "flag"], "float32"),
    (["i64", "i8"], None),  # int64 limits
    ("u64", None),  # uint64's largest
    (["f32", "nan_or_null", "int_null"], "float32"),  # integer nulls as NaN
    ((["f64", "i64"], "f32"), "float64"),  # a pytree of selections
    ("text", None), (["text", "big_text"], None), ("big_text", "int32"),  # string ids
    # numpy's unsafe casts from Polars' own arrays: NaN and inf into int32, int64/uint64 wrapped into int8,
    # nulls into float16, integer nulls into float64, a column twice in one leaf and again in another
    pytest.param(["f64", "f32"], "int32", marks=pytest.mark.filterwarnings("ignore:invalid value encountered")),
    (["i64", "u64"], "int8"), (["nan_or_null", "f32"], "float16"),
    ((["f32", "f32"], "int_null", ["i8", "f64", "i8"]), "float64"),
])
def test_polars_and_pyarrow_decode_the_same_rows(tmp_path, monkeypatch, columns, dtype):
    path = tmp_path / "edges.parquet"
    pq.write_table(edge_table(), path, row_group_size=128)
    polars = ParquetSource(path, columns=columns, dtype=dtype, decoder="polars")
    arrow = ParquetSource(path, columns=columns, dtype=dtype, decoder="pyarrow")
    auto = ParquetSource(path, columns=columns, dtype=dtype).decoder  # a file of a few KB: pyarrow's
    monkeypatch.setattr(tabular, "POLARS_MIN_FILE_BYTES", 0)
    assert (polars.decoder, arrow.decoder, auto, ParquetSource(path, columns=columns, dtype=dtype).decoder) == (
        "polars", "pyarrow", "pyarrow", "polars")
    assert polars.spec == arrow.spec
    # consecutive reads across row groups, one inside a row group, the ragged last step padded, a jump back
    for start, stop, pad in [(0, 100, None), (100, 300, None), (300, 301, None), (301, 900, None),
                             (900, 1000, 160), (10, 20, None), (640, 1000, None)]:
        same_rows(polars.read(start, stop, pad), arrow.read(start, stop, pad))
    polars.read(0, 10)
    scan = polars._stream
    for start in range(100, 1000, 100):  # one process's part of each step: the others' rows skipped, in one scan
        same_rows(polars.read(start, start + 30, 40), arrow.read(start, start + 30, 40))
    assert polars._stream is scan


def test_polars_numbers_are_cast_from_polars_arrays_not_through_arrow(tmp_path, monkeypatch):
    """Numbers decoded by Polars are cast from its own arrays (the GIL released: the pool scales), not converted
    to Arrow and cast by ``_fill``; integer nulls into float32 (pyarrow's chunks round them through float64 or
    not: the row groups holding one) and strings still go through Arrow."""
    path = tmp_path / "edges.parquet"
    pq.write_table(edge_table(), path, row_group_size=128)
    numbers = (["f64", "f32", "i64", "u64", "flag", "nan_or_null"], "float32")
    want = ParquetSource(path, columns=numbers[0], dtype=numbers[1], decoder="pyarrow").read(0, ROWS)
    via_arrow = []
    fill = tabular._fill
    monkeypatch.setattr(tabular, "_fill", lambda table, *args: via_arrow.append(table.num_rows) or fill(table, *args))
    same_rows(ParquetSource(path, columns=numbers[0], dtype=numbers[1], decoder="polars").read(0, ROWS), want)
    assert via_arrow == []
    for columns, dtype, rows in [(["f32", "int_null"], "float32", [128, 128, 104]), ("text", None, [128] * 7 + [104])]:
        ParquetSource(path, columns=columns, dtype=dtype, decoder="polars").read(0, ROWS)
        assert sorted(via_arrow) == sorted(rows)  # int_null's nulls: row groups 0, 1 and the last (on a pool)
        via_arrow.clear()


@pytest.mark.parametrize("block_rows", [None, 64])
def test_one_polars_query_decodes_several_row_groups_of_one_file_in_order(tmp_path, monkeypatch, block_rows):
    """Polars decodes consecutive row groups of one file in one query (a scan's first one row group, then twice as
    many each, up to ``POLARS_QUERY_BYTES``), never across files: the rows are pyarrow's bit for bit across the
    queries' edges, the ragged last row group, a one-row file, and a read that starts a scan in the middle of a
    query's row groups (a resume); cast a query at once (row groups under ``FILL_BLOCK_ROWS``) or a row group
    at a time (``block_rows=64``)."""
    if block_rows:
        monkeypatch.setattr(tabular, "FILL_BLOCK_ROWS", block_rows)
    table = edge_table()
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=128)  # 8 row groups, the last of 104 rows
    pq.write_table(table.slice(5, 1), tmp_path / "b.parquet")  # one row: inf
    paths = [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    monkeypatch.setattr(tabular, "POLARS_QUERY_BYTES", 3 * 128 * 4 * 8)  # 3 row groups of 4 float64 columns
    queries = []
    decode = ParquetSource._decode_query
    monkeypatch.setattr(ParquetSource, "_decode_query", lambda self, u, end: queries.append((u, end)) or decode(
        self, u, end))
    # a scan's queries grow from one row group: 1, 2, 4, ... up to POLARS_QUERY_BYTES
    for columns, dtype, want_queries, resumed_queries in [
            (["f64", "nan_or_null", "i64", "f32"], "float64", [(0, 1), (1, 3), (3, 6), (6, 8), (8, 9)],
             [(3, 4), (4, 6), (6, 8), (8, 9)]),  # Polars' arrays
            (["text", "big_text"], None, [(0, 1), (1, 3), (3, 7), (7, 8), (8, 9)],
             [(3, 4), (4, 6), (6, 8), (8, 9)])]:  # strings: through Arrow
        polars = ParquetSource(paths, columns=columns, dtype=dtype, decoder="polars")
        arrow = ParquetSource(paths, columns=columns, dtype=dtype, decoder="pyarrow")
        for start in range(0, ROWS + 1, 100):
            same_rows(polars.read(start, min(start + 100, ROWS + 1)), arrow.read(start, min(start + 100, ROWS + 1)))
        assert sorted(queries) == want_queries  # submitted in order, run on a pool
        queries.clear()
        resumed = ParquetSource(paths, columns=columns, dtype=dtype, decoder="polars")
        same_rows(resumed.read(450, ROWS + 1, 560), arrow.read(450, ROWS + 1, 560))  # row group 3 on
        assert sorted(queries) == resumed_queries
        queries.clear()


def test_a_row_group_polars_fails_on_is_read_by_pyarrow(tmp_path, monkeypatch):
    pl = pytest.importorskip("polars")
    path = tmp_path / "edges.parquet"
    pq.write_table(edge_table(), path, row_group_size=128)
    want = ParquetSource(path, columns=["f64", "i64"], dtype="float64", decoder="pyarrow").read(0, ROWS)

    def fails(*args, **kwargs):
        raise pl.exceptions.ComputeError("parquet: File out of specification")

    monkeypatch.setattr(pl, "scan_parquet", fails)
    same_rows(ParquetSource(path, columns=["f64", "i64"], dtype="float64", decoder="polars").read(0, ROWS), want)


def test_auto_takes_polars_by_the_bytes_a_file_holds_not_by_its_row_groups(tmp_path, monkeypatch):
    """Polars' queries of several row groups make small row groups cheap, while each file costs it a scan of its
    own: ``decoder="auto"`` weighs the bytes a file holds on average (``POLARS_MIN_FILE_BYTES``)."""
    table = edge_table()
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=128)  # 1000 rows x 16 bytes read, 2 KB a group
    pq.write_table(table.slice(0, 100), tmp_path / "b.parquet")
    monkeypatch.setattr(tabular, "POLARS_MIN_FILE_BYTES", ROWS * 16)
    assert ParquetSource(tmp_path / "a.parquet", columns=["f64", "f32"], dtype="float64").decoder == "polars"
    assert ParquetSource(tmp_path, columns=["f64", "f32"], dtype="float64").decoder == "pyarrow"  # 8,800 a file


def test_a_dataset_polars_cannot_read_is_one_line_or_pyarrows_under_auto(tmp_path, monkeypatch):
    monkeypatch.setattr(tabular, "POLARS_MIN_FILE_BYTES", 0)  # auto would take Polars where it reads the columns
    path = tmp_path / "vec.parquet"
    pq.write_table(pa.table({"v": pa.array([[1.0, 2.0]] * 4, pa.list_(pa.float64(), 2)), "h": pa.array(
        np.ones(4, np.float16))}), path)
    for columns in ("v", "h"):
        assert ParquetSource(path, columns=columns).decoder == "pyarrow"
        with pytest.raises(UsageError, match=r"decoder='polars' cannot .*Polars leaves the types of .* to pyarrow"):
            ParquetSource(path, columns=columns, decoder="polars")
    with pytest.raises(UsageError, match=r"decoder must be one of 'auto', 'polars', 'pyarrow', got 'duckdb'"):
        ParquetSource(path, columns="v", decoder="duckdb")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
@pytest.mark.filterwarnings("ignore:os.fork")  # JAX's: the child runs no JAX
def test_a_child_forked_after_polars_ran_decodes_with_pyarrow_where_polars_would_hang(tmp_path):
    path = tmp_path / "edges.parquet"
    pq.write_table(edge_table(), path, row_group_size=128)
    parents = ParquetSource(path, columns=["f64", "i64"], dtype="float64", decoder="polars")
    parents.read(0, 300)  # Polars' threads ran, and a scan of it is left mid-file
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.alarm(30)  # a hung Polars query ends the child, which the parent sees
        ok = False
        try:
            want = ParquetSource(path, columns=["f64", "i64"], dtype="float64", decoder="pyarrow").read(300, 600)
            tabular.POLARS_MIN_FILE_BYTES = 0  # auto would take Polars, but for the fork
            fresh = ParquetSource(path, columns=["f64", "i64"], dtype="float64")
            ok = fresh.decoder == "pyarrow" and all(
                got.tobytes() == want.tobytes() for got in (fresh.read(300, 600), parents.read(300, 600)))
        finally:
            os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0


def edge_csv(path, rows=ROWS, late=None):
    """A CSV of the values a reader may parse its own way: pyarrow's null words (NaN, nan, N/A, an empty or a
    quoted empty field), inf, -0.0, a subnormal, an overflow, int64's limits (nulls as NaN in float64), bools, and
    strings with commas, quotes, newlines, CRLF, NUL, unicode and spaces; ``late``: a row whose float Polars does
    not parse (``"2.5 "``)."""
    rng = np.random.default_rng(5)
    floats = np.array(["1.5", "NaN", "nan", "", "inf", "-inf", "-0.0", "1e-320", "1e400", "N/A", '"NA"', '""',
                       "-7.25e-3", "0"], object)[rng.integers(0, 14, rows)]
    ints = rng.integers(-9, 9, rows).astype(object)
    ints[[3, 4, 9]] = [str(I64.min), str(I64.max), ""]
    words = np.array(['"a,b"', '"line\nbreak"', '"q""uote"', "ünï 日本", "", '"x\x00y"', '"cr\r\nlf"', " sp ", "NA",
                      "🙂"], object)[rng.integers(0, 10, rows)]
    flags = np.array(["true", "false", "True", "FALSE"], object)[rng.integers(0, 4, rows)]
    lines = [f"{f},{i},{w},{b}" for f, i, w, b in zip(floats, ints, words, flags, strict=True)]
    if late is not None:
        lines[late] = lines[late].replace(lines[late].split(",")[0], "2.5 ", 1)
    with open(path, "w", newline="") as f:
        f.write("f,i,s,b\n" + "\n".join(lines) + "\n")


@pytest.mark.parametrize("columns, dtype, late", [
    (["f", "i", "b"], "float64", None),  # NaN, nulls, int64 extremes and a null as float64, bools
    (["f", "i"], "float64", 700),  # Polars fails on row 700's "2.5 ": pyarrow reads on from the row it was at
    ("s", None, None), ("s", "int32", None),  # string ids
])
def test_csv_polars_and_pyarrow_parse_the_same_rows(tmp_path, monkeypatch, columns, dtype, late):
    path = tmp_path / "edges.csv"
    edge_csv(path, late=late)
    monkeypatch.setattr(tabular, "CSV_BATCH_ROWS", 128)  # several batches, a ragged last one
    polars = CsvSource(path, columns=columns, dtype=dtype, decoder="polars")
    arrow = CsvSource(path, columns=columns, dtype=dtype, decoder="pyarrow")
    assert (polars.decoder, arrow.decoder, polars.spec) == ("polars", "pyarrow", arrow.spec)
    for start, stop, pad in [(0, 100, None), (100, 300, None), (300, 301, None), (310, 900, None),
                             (900, 1000, 160)]:
        same_rows(polars.read(start, stop, pad), arrow.read(start, stop, pad))
    assert polars.decoder == ("pyarrow" if late else "polars")
    resumed = CsvSource(path, columns=columns, dtype=dtype, decoder="polars")
    resumed.seek(500)  # a resume: Polars starts at the row
    fresh = CsvSource(path, columns=columns, dtype=dtype, decoder="pyarrow")
    same_rows(resumed.read(500, 800), fresh.read(500, 800))


def test_csv_decoders_refuse_the_same_and_blank_lines_are_pyarrows(tmp_path, monkeypatch):
    path = tmp_path / "rows.csv"
    path.write_text("a,b\n1,2.5\n3,\n5,6\n")
    for decoder in ("pyarrow", "polars"):  # nulls an int64 cannot hold, a ragged row: one line, either decoder
        with pytest.raises(UsageError, match="column 'b' of .* has nulls near row 0, which int64 cannot hold") as e:
            CsvSource(path, columns=["a", "b"], dtype="int64", decoder=decoder)
        assert "\n" not in str(e.value)
    path.write_text("a,b\n1,2\n3\n5,6\n")
    for decoder in ("pyarrow", "polars"):
        with pytest.raises(UsageError, match="cannot read .* as CSV: CSV parse error: Expected 2 columns, got 1"):
            CsvSource(path, columns="a", decoder=decoder)
    path.write_text("a,s\n1,x\n\n3,y\n\n")  # blank lines: pyarrow skips them, Polars reads rows of nulls
    monkeypatch.setattr(tabular, "POLARS_MIN_CSV_BYTES", 0)
    assert CsvSource(path, columns="s").decoder == "pyarrow"
    with pytest.raises(UsageError, match=r"decoder='polars' cannot .*Polars counts 4 rows where pyarrow counts 2"):
        CsvSource(path, columns="s", decoder="polars")
    path.write_text("a,s\n1,x\n3,y\n")
    assert (CsvSource(path, columns="s").decoder, CsvSource(path, columns="a").decoder) == ("polars", "pyarrow")
    with pytest.raises(UsageError, match=r"decoder must be one of 'auto', 'polars', 'pyarrow', got 'duckdb'"):
        CsvSource(path, columns="a", decoder="duckdb")
