"""Vector columns (Arrow lists, pandas columns of arrays) and string columns, against numpy and pandas."""

import warnings

import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.sources import CsvSource, ParquetSource, dataframe_source
from tests.helpers import assert_usage_error, rel_err

pd = pytest.importorskip("pandas")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

K = 6  # values of a state vector
EPISODES = 20


def episode(e: int, rng: np.random.Generator, vector: pa.DataType) -> pa.Table:
    """One episode as a robot-learning dataset (LeRobot's layout) stores it: one file, vectors as lists."""
    n = int(rng.integers(30, 90))
    state = rng.normal(e, 1 + e / 10, (n, K)).astype(np.float32)
    return pa.table({
        "observation.state": pa.array(list(state), vector),
        "action": pa.array(list(rng.normal(0, 1, (n, K)).astype(np.float32)), pa.list_(pa.float32())),
        "timestamp": pa.array(np.arange(n, dtype=np.float32) / 30),
        "frame_index": pa.array(np.arange(n)),
        "episode_index": pa.array(np.full(n, e)),
        "task": pa.array(rng.choice(["pick", "place", "push"], n, p=[0.6, 0.3, 0.1])),
    })


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
    """20 Parquet files, one an episode (small row groups: reads cross groups and files), and their rows."""
    where = tmp_path_factory.mktemp("episodes")
    rng = np.random.default_rng(0)
    tables = [episode(e, rng, pa.list_(pa.float32(), K)) for e in range(EPISODES)]
    (where / "data").mkdir()
    for e, table in enumerate(tables):
        pq.write_table(table, where / "data" / f"episode_{e:06d}.parquet", row_group_size=25)
    whole = pa.concat_tables(tables)
    rows = {name: np.stack(whole.column(name).to_pylist()).astype(np.float32) if name in ("observation.state", "action")
            else whole.column(name).to_numpy() for name in whole.column_names}
    return where / "data", rows


@pytest.mark.parametrize("kind", ["fixed_size_list", "list", "pandas arrays", "feather"])
def test_a_vector_column_is_rows_of_its_values_for_any_range(tmp_path, kind):
    rng = np.random.default_rng(1)
    vec = rng.normal(size=(301, K)).astype(np.float32)
    a = rng.normal(size=301)
    frame = pd.DataFrame({"a": a, "vec": list(vec)})  # a pandas column of equal-length arrays
    if kind == "pandas arrays":
        make = lambda **kw: dataframe_source(frame, **kw)  # noqa: E731
    else:
        vector = pa.list_(pa.float32(), K) if kind != "list" else pa.list_(pa.float32())
        table = pa.table({"a": a, "vec": pa.array(list(vec), vector)})
        if kind == "feather":
            import pyarrow.feather as feather

            feather.write_feather(table, tmp_path / "t.arrow")
            make = lambda **kw: ParquetSource(tmp_path / "t.arrow", format="feather", **kw)  # noqa: E731
        else:
            pq.write_table(table, tmp_path / "t.parquet", row_group_size=50)
            make = lambda **kw: ParquetSource(tmp_path / "t.parquet", **kw)  # noqa: E731
    alone, both = make(columns="vec"), make(columns=["a", "vec"], dtype="float64")
    tree = make(columns={"state": "vec", "a": "a"}, dtype="float64")
    assert alone.spec.shape == (K,) and alone.spec.dtype == np.float32 and both.spec.shape == (1 + K,)
    assert alone.column_names == [f"vec[{i}]" for i in range(K)]
    assert both.column_names == ["a"] + [f"vec[{i}]" for i in range(K)]
    for start, stop in [(0, 7), (7, 49), (49, 160), (160, 301)]:
        np.testing.assert_array_equal(alone.read(start, stop), vec[start:stop])
        np.testing.assert_array_equal(both.read(start, stop), np.c_[a, vec.astype(np.float64)][start:stop])
        got = tree.read(start, stop)
        np.testing.assert_array_equal(got["state"], vec[start:stop].astype(np.float64))
        np.testing.assert_array_equal(got["a"], a[start:stop])
    padded = alone.read(290, 301, pad_to=16)
    np.testing.assert_array_equal(padded, np.r_[vec[290:], np.zeros((5, K), np.float32)])


@pytest.mark.parametrize("layout", ["directory", "glob"])
def test_per_dimension_statistics_of_an_episode_dataset_match_numpy(episodes, layout):
    where, rows = episodes
    path = where if layout == "directory" else str(where / "episode_*.parquet")
    state = rows["observation.state"].astype(np.float64)
    m = ss.run(ss.Moments(), ParquetSource(path, columns="observation.state"), mesh="data:8", microbatch=64)
    assert m.columns.tolist() == [f"observation.state[{i}]" for i in range(K)]
    assert int(m.count) == len(state)
    assert rel_err(m.mean, state.mean(0)) < 1e-6 and rel_err(m.var, state.var(0)) < 1e-5
    np.testing.assert_array_equal(m.min, state.min(0))
    np.testing.assert_array_equal(m.max, state.max(0))
    q = ss.run(ss.Quantiles(qs=[0.01, 0.99], exact=True, method="lower"),
               ParquetSource(path, columns="observation.state"), mesh="data:4", microbatch=64)
    np.testing.assert_array_equal(q.quantiles, np.quantile(state, [0.01, 0.99], axis=0, method="lower").T)
    x = ParquetSource(path, columns=["timestamp", "action"])
    assert x.spec.shape == (1 + K,) and x.column_names[:2] == ["timestamp", "action[0]"]
    want = np.c_[rows["timestamp"], rows["action"]]
    for start, stop in [(0, 1), (1, 333), (333, 700), (700, len(state))]:  # across row groups and files
        np.testing.assert_array_equal(x.read(start, stop), want[start:stop])


def test_a_list_of_another_length_is_one_line_naming_its_row_and_file(episodes, tmp_path):
    where, _ = episodes
    table = episode(0, np.random.default_rng(5), pa.list_(pa.float32()))
    lists = table.column("observation.state").to_pylist()
    lists[17] = lists[17][:4]
    for e in range(3):
        bad = table.set_column(0, "observation.state", pa.array(lists, pa.list_(pa.float32()))) if e == 2 else table
        pq.write_table(bad, tmp_path / f"episode_{e}.parquet")
    source = ParquetSource(tmp_path, columns="observation.state")
    assert_usage_error(lambda: source.read(0, source.num_rows),
                       ["'observation.state'", "episode_2.parquet", f"row {2 * table.num_rows + 17}", "4 values", "6"])
    ragged = pd.DataFrame({"v": [np.zeros(3), np.zeros(3), np.zeros(2)]})
    assert_usage_error(lambda: dataframe_source(ragged), ["'v'", "row 2", "2 values", "3"])
    pq.write_table(pa.table({"v": pa.array([None, [1.0]], pa.list_(pa.float32()))}), tmp_path / "null_first.parquet",
                   row_group_size=1)
    assert_usage_error(lambda: ParquetSource(tmp_path / "null_first.parquet", columns="v"),
                       ["'v'", "no list", "fixed_size_list"])


def test_nulls_in_vectors_are_nan_or_one_line_in_integer_dtypes(tmp_path):
    values = pa.array([[1.0, 2.0], None, [3.0, None], [5.0, 6.0]], pa.list_(pa.float32(), 2))
    pq.write_table(pa.table({"v": values}), tmp_path / "nulls.parquet", row_group_size=3)
    got = ParquetSource(tmp_path / "nulls.parquet", columns="v").read(0, 4)
    np.testing.assert_array_equal(got, [[1, 2], [np.nan, np.nan], [3, np.nan], [5, 6]])
    omitted = ss.run(ss.Sum(), ParquetSource(tmp_path / "nulls.parquet", columns="v"), nan_policy="omit")
    assert int(omitted.count) == 4 and omitted.sum.tolist() == [9.0, 8.0]  # each NaN skipped where it stands
    for name, ints in (("inner", pa.array([[1, 2], [3, None]], pa.list_(pa.int32()))),
                       ("row", pa.array([[1, 2], None], pa.list_(pa.int32(), 2)))):
        pq.write_table(pa.table({"v": ints}), tmp_path / f"{name}.parquet")
        assert_usage_error(lambda: ParquetSource(tmp_path / f"{name}.parquet", columns="v").read(0, 2),  # noqa: B023
                           ["'v'", "nulls", "int32", "float32"])


@pytest.fixture(scope="module")
def words(tmp_path_factory):
    """A column of Zipf-like words (a vocabulary's data) beside a number, as Parquet, CSV and a DataFrame."""
    rng = np.random.default_rng(2)
    vocabulary = np.array([f"w{i}" for i in range(400)] + ["é", "naïve", "日本"])
    p = 1 / np.arange(1, len(vocabulary) + 1) ** 1.1
    frame = pd.DataFrame({"word": rng.choice(vocabulary, 5000, p=p / p.sum()), "n": rng.normal(size=5000)})
    frame.loc[4990:, "word"] = "rare-at-the-end"  # listed only with k large: found by reading to the end
    where = tmp_path_factory.mktemp("words")
    frame.to_parquet(where / "words.parquet", row_group_size=700)
    frame.to_csv(where / "words.csv", index=False)
    return where, frame


VOCABULARY_JOB = {"mesh": "data:2", "microbatch": 256, "steps_per_call": 4}


@pytest.mark.parametrize("kind", ["parquet", "csv", "frame"])
def test_a_vocabulary_is_one_call_topk_of_a_string_column_like_value_counts(words, kind):
    where, frame = words
    make = {"parquet": lambda: ParquetSource(where / "words.parquet", columns="word"),
            "csv": lambda: CsvSource(where / "words.csv", columns="word", block_bytes=4096),
            "frame": lambda: dataframe_source(frame, columns="word")}[kind]
    # One layout and one column (not a list of one): the kinds share compiled programs. A frame of strings only,
    # columns=None (its string columns, a list of one): test_strings_exact's every run.
    job = VOCABULARY_JOB
    top = ss.run(ss.TopK(k=20, capacity=500), make(), **job)  # k=500's accumulator: its programs (k: finalize only)
    values, counts = np.ravel(top.values), np.ravel(top.counts)
    want = frame.word.value_counts()
    assert counts.tolist() == want.to_numpy()[:20].tolist()  # ties come in another order than pandas'
    assert [want[v] for v in values] == counts.tolist() and values[0] == want.index[0]
    assert top.columns.tolist() == ["word"] and bool(top.certain)
    every = ss.run(ss.TopK(k=500, capacity=500), make(), **job)  # every word, then "" (count 0)
    values, counts = np.ravel(every.values), np.ravel(every.counts)
    assert dict(zip(values[counts > 0].tolist(), counts[counts > 0].tolist(), strict=True)) == want.to_dict()
    assert set(values[counts == 0].tolist()) == {""}
    n = ss.run(ss.DistinctCount(exact_up_to=4096), make(), **job)
    assert np.ravel(n.count).tolist() == [frame.word.nunique()]


def test_columns_none_names_the_string_columns_it_leaves_out(words):
    _, frame = words
    with pytest.warns(UserWarning, match="leaves out 'word'.*TopK"):
        source = dataframe_source(frame)
    assert source.column_names == ["n"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left out: no warning
        dataframe_source(frame[["n"]])
        dataframe_source(frame[["word"]])
    assert_usage_error(lambda: ss.run(ss.Moments(), frame[["word"]]), ["'word'", "Moments", "not as numbers"])
    x_and_y = (dataframe_source(frame, columns=["word"]), frame.n.to_numpy())  # a pytree of sources
    assert_usage_error(lambda: ss.run(ss.LinearRegression(), x_and_y), ["'word'", "LinearRegression"])


def test_topk_of_hash_ids_names_its_one_column():
    ids = ss.hash_strings(["a", "b", "a"] * 700)  # rows of one id, as a string column's: the vocabulary's programs
    top = ss.run(ss.TopK(k=2, capacity=500), ids, **VOCABULARY_JOB)
    assert top.columns.tolist() == [0] and top.counts.tolist() == [1400, 700]
    np.testing.assert_array_equal(top.values, ids[:2])
