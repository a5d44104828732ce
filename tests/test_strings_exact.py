"""String columns counted exactly (issue 42: findings 1, 2, 10, 12, 14): 64-bit ids of the strings' UTF-8
bytes (DataSketches' MurmurHash3), results that list Python strings checked against the column, and a
DistinctCount whose `exact` accounts for the hash. Every run here reads 12 rows of one string column on
`data:1`, so the runs share their shapes (one device's programs compile in about two thirds of two's; string
columns' ids merged over devices: test_columns' vocabulary on data:2, 64-bit ids over 8: test_float_extremes)."""

import math

import numpy as np
import pandas as pd
import pytest

import sharded_scan as ss
from sharded_scan.combiners.sketches import topk_strings
from sharded_scan.combiners.sketches.datasketches import read_hll
from sharded_scan.combiners.sketches.distinct import DistinctCountResult
from sharded_scan.sources import tabular
from sharded_scan.workdir import run_in_workdir
from tests.helpers import assert_usage_error

ds = pytest.importorskip("datasketches")
RUN = dict(mesh="data:1", microbatch=8)
# Two strings whose 32-bit BLAKE2b ids (the ids before) were one: 5 and 3 rows, and 4 rows of another.
SHARED = ["user49971"] * 5 + ["user52600"] * 3 + ["other"] * 4
groups = np.array([0, 1] * 6)  # each row's key


def frame(strings):
    return pd.DataFrame({"w": np.array(strings, dtype=object)})


def coupon(string: str) -> int:
    """DataSketches' own coupon of ``string``: a one-item HLL sketch's LIST-mode bytes."""
    sketch = ds.hll_sketch(21, ds.HLL_8)
    sketch.update(string)
    return int.from_bytes(sketch.serialize_updatable()[8:12], "little")


def test_string_ids_are_64_bit_murmur3_of_the_utf8_bytes_as_datasketches_hashes():
    words = [f"user{i}" for i in range(52601)]
    ids = ss.hash_strings(words)
    assert ids.dtype == np.int64 and len(np.unique(ids)) == len(words)  # 32-bit ids: user49971 == user52600
    assert np.array_equal(ss.hash_strings(words[:3]), ids[:3])  # stable
    # an id holds h1's low 26 bits (the coupon's slot) and h2's top 38 (its value: h2's leading zeros + 1)
    for s in ["a", "Köln", "exactly16bytes!!", "seventeen bytes!!", "é" * 33, "\U0001f600\x00"]:
        (i,) = ss.hash_strings([s]).view(np.uint64).tolist()
        clz = 64 - (i >> 26 << 26).bit_length()
        assert coupon(s) == (i & (2**26 - 1)) | (min(clz, 62) + 1) << 26, s


def test_topk_and_distinct_count_keep_apart_strings_whose_32_bit_ids_were_one():
    top = ss.run(ss.TopK(k=6), frame(SHARED), **RUN)  # the program of test_strings_keep_trailing_nuls_...
    assert top.values[0][:3].tolist() == ["user49971", "other", "user52600"] and top.counts[0].tolist() == [5, 4, 3,
                                                                                                            0, 0, 0]
    assert top.certain[0] and top.values.dtype == object
    distinct = ss.run(ss.DistinctCount(), frame(SHARED), **RUN)
    assert distinct.count.tolist() == [3] and distinct.exact.all()


def test_a_shared_id_is_listed_apart_with_exact_counts_or_said_in_one_line(monkeypatch):
    a, b = ss.hash_strings(["user49971", "user52600"]).tolist()
    real = tabular.string_ids_of_utf8
    monkeypatch.setattr(tabular, "string_ids_of_utf8", lambda data, offsets: np.where(
        real(data, offsets) == b, a, real(data, offsets)))  # a 64-bit collision, made to order
    top = ss.run(ss.TopK(k=2), frame(SHARED), **RUN)  # the devices count the pair as one id: 8 rows
    assert top.values[0].tolist() == ["user49971", "other"] and top.counts[0].tolist() == [5, 4]
    assert top.bound[0] == 3 and top.certain[0]  # user52600, split off and left out: under the bound
    with pytest.warns(UserWarning, match="share the id") as said:
        grouped = ss.run(ss.GroupBy(ss.TopK(k=3), 2), (groups, frame(SHARED)), **RUN)
    shared = {str(w.message) for w in said if "share the id" in str(w.message)}
    assert len(shared) == 1 and "\n" not in shared.pop(), [str(w.message) for w in said]  # one line, for every key
    assert not grouped.certain.any()  # counts per key of two strings together: never certain


def test_distinct_count_is_exact_only_while_a_shared_id_is_at_most_1e_9_likely():
    n = topk_strings.EXACT_STRINGS
    assert n * (n - 1) / 2 / 2.0**64 <= 1e-9 < (n + 1) * n / 2 / 2.0**64
    assert "1e-9" in ss.DistinctCount.__doc__ and f"{n:,}" in ss.DistinctCount.__doc__
    many = DistinctCountResult(np.array([n, n + 1, n + 1]), np.array([True, True, False]), np.array([0, 0, 0.01]))
    got = topk_strings.with_strings(many, ["w"] * 3, frame(["x"]).pipe(tabular.dataframe_source))
    assert got.exact.tolist() == [True, False, False] and got.relative_error[2] == 0.01
    assert 0 < got.relative_error[1] < 1e-13  # the expected share of strings lost to shared ids


def test_distinct_count_datasketches_of_strings_sets_datasketches_own_registers():
    words = [f"w{i}" for i in range(500)]
    count = ss.DistinctCount(precision=12, datasketches=True)
    mine = ss.run(count, frame(words), **RUN)
    theirs = ds.hll_sketch(12, ds.HLL_8)
    for s in words:
        theirs.update(s)
    np.testing.assert_array_equal(read_hll(mine.to_datasketches()[0]), read_hll(theirs.serialize_compact()))
    union = ds.hll_union(12)
    union.update(theirs)
    union.update(ds.hll_sketch.deserialize(mine.to_datasketches()[0]))
    assert abs(union.get_estimate() - 500) < 500 * 3 * 1.04 / math.sqrt(4096)  # not 999: each string once
    seeded = ss.run(ss.from_datasketches(count, [theirs.serialize_compact()]), frame(words), **RUN)  # the same
    np.testing.assert_array_equal(read_hll(seeded.to_datasketches()[0]), read_hll(theirs.serialize_compact()))


def test_strings_keep_trailing_nuls_and_every_code_point_through_results_and_the_workdir(tmp_path):
    strings = ["a"] * 3 + ["a\x00"] * 4 + ["é\x00\x00"] * 2 + ["\U0001f600", "\x00", ""]
    top = ss.run(ss.TopK(k=6), frame(strings), **RUN)
    counts = pd.Series(strings).value_counts()
    want = sorted(counts.index, key=lambda s: (-counts[s], int(ss.hash_strings([s])[0])))  # ties: id order
    assert top.values[0].tolist() == want and top.counts[0].tolist() == [4, 3, 2, 1, 1, 1]
    assert top.to_pandas()["values"].tolist() == top.values[0].tolist()
    assert ss.run(ss.DistinctCount(), frame(strings), **RUN).count.tolist() == [6]
    for _ in range(2):  # the run, then "already done": result.npz read back
        got, summary = run_in_workdir(ss.TopK(k=6), tabular.dataframe_source(frame(strings)), tmp_path, **RUN)
        values = got["values"] if summary.get("already_done") else got.values
        assert values.dtype == object and values[0].tolist() == top.values[0].tolist()
    assert summary["already_done"]


def test_groupby_and_weighted_of_string_columns_give_the_strings_and_their_own_counts():
    grouped = ss.run(ss.GroupBy(ss.TopK(k=3), 2), (groups, frame(SHARED)), **RUN)
    for k in range(2):
        want = pd.Series(SHARED)[groups == k].value_counts()
        assert dict(zip(grouped.values[k, 0], grouped.counts[k, 0], strict=True)) == want.to_dict()
    weights = np.arange(12.0)
    weighted = ss.run(ss.Weighted(ss.TopK(k=3)), (weights, frame(SHARED)), **RUN)
    want = pd.Series(weights).groupby(np.array(SHARED)).sum().sort_values(ascending=False)
    assert weighted.values[0].tolist() == want.index.tolist() and weighted.counts[0].tolist() == want.tolist()
    distinct = ss.run(ss.GroupBy(ss.DistinctCount(), 2), (groups, frame(SHARED)), **RUN)
    assert distinct.count[:, 0].tolist() == [3, 3] and distinct.rows.tolist() == [6, 6]  # count: the inner one


def test_a_lone_surrogate_is_one_line():
    assert_usage_error(lambda: ss.hash_strings(["ok", "a\ud800"]), ["string 1", "lone surrogate", "UTF-8"])
    odd = pd.DataFrame({"w": np.array(["a\ud800", "b"], dtype=object)}, dtype=object)  # pandas' own strings refuse it
    assert_usage_error(lambda: ss.run(ss.TopK(), odd), ["lone surrogate", "UTF-8"])


def test_the_32_bit_ids_of_dtype_int32_where_no_64_bit_values_are_checked_the_same_way():
    narrow = tabular.dataframe_source(frame(SHARED), dtype="int32")  # what a TPU takes: the ids' low 32 bits
    assert narrow.spec.dtype == np.int32 and topk_strings.exact_strings(32) == 3
    top = ss.run(ss.TopK(k=3), narrow, **RUN)
    assert top.values[0].tolist() == ["user49971", "other", "user52600"] and top.counts[0].tolist() == [5, 4, 3]
    distinct = ss.run(ss.DistinctCount(), tabular.dataframe_source(frame(SHARED), dtype="int32"), **RUN)
    assert distinct.count.tolist() == [3] and distinct.exact.all()  # 3 strings: a shared id at most 1e-9 likely
    more = ss.run(ss.DistinctCount(), tabular.dataframe_source(frame(SHARED[:8] + list("abcd")), dtype="int32"), **RUN)
    assert more.count.tolist() == [6] and not more.exact.any() and 0 < more.relative_error[0] < 1e-8
    assert_usage_error(lambda: ss.run(ss.DistinctCount(datasketches=True), narrow, **RUN),
                       ["datasketches=True", "64-bit ids", "int32", "dtype unset"])
    assert_usage_error(lambda: tabular.dataframe_source(frame(SHARED), dtype="float32"), ["int64 ids", "int32"])
