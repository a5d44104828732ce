"""Sketches other systems read: Quantiles' KLL, TopK's Frequent Items and DistinctCount's HLL bytes, read and
merged by the ``datasketches`` package (the reference), and runs seeded from the package's own sketches.

Compiles are the cost: one Quantiles, one TopK and one DistinctCount, each on one spec and mesh, shared
by every case through module fixtures; the float64 KLL path is checked on its bytes."""

import struct

import jax
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.combiners.sketches import datasketches as formats
from sharded_scan.combiners.sketches import keys, murmur

ds = pytest.importorskip("datasketches")

QUANTILES = ss.Quantiles(qs=[0.1, 0.5, 0.9], k=64)  # small k: a few thousand rows compact the sketch
TOPK = ss.TopK(k=3, capacity=32)
DISTINCT = ss.DistinctCount(precision=10, exact_up_to=0, datasketches=True)
RUN = dict(microbatch=128, steps_per_call=2, mesh="data:2")
ONE = {**RUN, "mesh": "data:1"}  # the KLL merge's compile is test_quantiles'; here the formats
# (a seeded combiner equals its inner one: the seeded runs reuse the fixtures' compiled programs)
QS = np.linspace(0.05, 0.95, 19)
ROWS = 2501  # ragged


def rank(values, v) -> float:
    """The normalized rank of ``v`` among ``values``: the share below it, and half of those equal."""
    s = np.sort(values)
    return (np.searchsorted(s, v, "left") + np.searchsorted(s, v, "right")) / 2 / len(s)


def package_kll(cls, values, k=200):
    sketch = cls(k)
    for v in values:
        sketch.update(float(v))
    return sketch


def package_frequent(values, lg=6):
    sketch = ds.frequent_items_sketch(lg)
    for v in values:
        sketch.update(int(v))
    return sketch


def check_ranks(sketch, values, error):
    """Every quantile the package reads from ``sketch`` has its true rank within ``error`` of q."""
    for q in QS:
        assert abs(rank(values, sketch.get_quantile(q)) - q) <= error, q


def check_counts(sketch, values):
    """The package's bounds hold every value's true count."""
    found, counts = np.unique(values, return_counts=True)
    for value, count in zip(found.tolist(), counts, strict=True):
        assert sketch.get_lower_bound(value) <= count <= sketch.get_upper_bound(value), value


@pytest.fixture(scope="module")
def floats():
    rng = np.random.default_rng(1)
    x = np.stack([rng.normal(size=ROWS) * 1e6, rng.exponential(size=ROWS)], 1).astype(np.float32)
    x[[5, 900], 1] = np.nan  # DataSketches leaves NaN out; so does the export
    return x, ss.run(QUANTILES, x, **ONE)


@pytest.fixture(scope="module")
def ints():
    rng = np.random.default_rng(2)
    x = np.stack([rng.zipf(1.3, size=ROWS) % 500, rng.integers(0, 4, size=ROWS)], 1).astype(np.int32)
    return x, ss.run(TOPK, x, **RUN)


def test_kll_bytes_are_the_sketch_and_merge_with_the_packages(floats):
    x, result = floats
    blobs = result.to_datasketches()
    assert len(blobs) == 2
    rng = np.random.default_rng(3)
    for j, blob in enumerate(blobs):
        values = x[:, j][~np.isnan(x[:, j])]
        ours = ds.kll_floats_sketch.deserialize(blob)  # float32 columns: floats sketches
        assert ours.is_estimation_mode() and ours.k == 64
        assert abs(ours.n - len(values)) <= result.rank_error * len(values)  # n: the items' weight
        assert ours.get_min_value() == values.min()
        if j == 0:
            assert ours.get_max_value() == values.max()
        else:  # the NaN column's largest key is NaN: its max is the largest item kept
            assert ours.get_max_value() in values and rank(values, ours.get_max_value()) >= 1 - result.rank_error
        check_ranks(ours, values, ours.normalized_rank_error(False))
        other = (rng.uniform(-1, 3, size=3000) * values.std()).astype(np.float32)
        union = package_kll(ds.kll_floats_sketch, other)
        union.merge(ours)
        both = np.concatenate([values, other])
        assert union.n == ours.n + len(other) and union.get_min_value() == min(values.min(), other.min())
        check_ranks(union, both, union.normalized_rank_error(False))  # min_k: ours, the smaller


def test_kll_bytes_read_back_and_the_small_forms():
    values = np.random.default_rng(5).normal(size=1000)
    image = formats.read_kll(package_kll(ds.kll_doubles_sketch, values, k=50).serialize())
    assert image.n == 1000 and image.k == 50 and image.itemsize == 8
    assert sum(len(items) << h for h, items in enumerate(image.levels)) == 1000
    assert image.min == values.min() and image.max == values.max()
    again = ds.kll_doubles_sketch.deserialize(formats.kll_bytes(image.levels, 50, image.min, image.max, 8))
    check_ranks(again, values, again.normalized_rank_error(False))
    single = ds.kll_floats_sketch.deserialize(formats.kll_bytes([np.array([2.5])], 64, 2.5, 2.5, 4))
    assert single.n == 1 and single.get_quantile(0.5) == 2.5
    assert formats.read_kll(single.serialize()).levels[0].tolist() == [2.5]
    assert ds.kll_floats_sketch.deserialize(formats.kll_bytes([], 64, 0, 0, 4)).is_empty()


def test_a_run_seeded_with_the_packages_kll_sketches_answers_for_the_union(floats):
    x, plain = floats
    theirs = np.random.default_rng(6).normal(2e6, 1e6, size=4000).astype(np.float32)  # doubles float32 holds
    seeds = [package_kll(ds.kll_doubles_sketch, theirs, k=100).serialize(), None]
    result = ss.run(ss.from_datasketches(QUANTILES, seeds, item="double"), x, **ONE)
    np.testing.assert_array_equal(result.count, [ROWS + 4000, ROWS])
    union = np.concatenate([x[:, 0], theirs])
    for q, v in zip(QUANTILES.qs, result.quantiles[0], strict=True):
        assert abs(rank(union, v) - q) <= result.rank_error, q
    np.testing.assert_array_equal(result.quantiles[1], plain.quantiles[1])  # no seed: the run's own
    back = ds.kll_floats_sketch.deserialize(result.to_datasketches()[0])
    assert back.get_min_value() == union.min() and back.get_max_value() == union.max()
    assert abs(back.n - len(union)) <= result.rank_error * len(union)
    check_ranks(back, union, result.rank_error)


def test_frequent_items_bytes_bound_every_count_and_merge_with_the_packages(ints):
    x, result = ints
    blobs = result.to_datasketches()
    other = np.random.default_rng(7).zipf(1.5, size=2000) % 300
    for j, blob in enumerate(blobs):
        ours = ds.frequent_items_sketch.deserialize(blob, ds.PyLongsSerDe())
        check_counts(ours, x[:, j])
        union = package_frequent(other)
        union.merge(ours)
        both = np.concatenate([x[:, j], other])
        check_counts(union, both)
        found, counts = np.unique(both, return_counts=True)
        top = union.get_frequent_items(ds.frequent_items_error_type.NO_FALSE_NEGATIVES)
        assert top[0][0] == found[np.argmax(counts)]
    assert ds.frequent_items_sketch.deserialize(blobs[1], ds.PyLongsSerDe()).get_upper_bound(9) == 0  # exact: 4 values


def test_frequent_items_of_strings_and_doubles():
    pd = pytest.importorskip("pandas")
    rng = np.random.default_rng(8)  # two string columns, read as int64 (2,) ids
    words = np.array(["a", "bb", "ccc", "dddd", "é"])[rng.integers(0, 5, size=(ROWS, 2))]
    result = ss.run(TOPK, pd.DataFrame({"w": words[:, 0], "v": words[:, 1]}), **RUN)
    for j, blob in enumerate(result.to_datasketches()):
        sketch = ds.frequent_strings_sketch.deserialize(blob)
        check_counts(sketch, words[:, j])  # the 3 listed, and the 2 left out under the offset
    blob = formats.frequent_items_bytes(np.array([0.5, 3.0]), [30, 10], 2, 45, 32, "double")
    doubles = ds.frequent_items_sketch.deserialize(blob, ds.PyDoublesSerDe())
    assert doubles.get_estimate(0.5) == 32 and doubles.get_upper_bound(7.0) == 2 and doubles.total_weight == 45
    image = formats.read_frequent_items(doubles.serialize(ds.PyDoublesSerDe()), "double")
    assert sorted(zip(image.items, image.weights.tolist(), strict=True)) == [(0.5, 30), (3.0, 10)]


def test_a_run_seeded_with_the_packages_frequent_items_counts_the_union(ints):
    x, plain = ints
    theirs = np.random.default_rng(9).zipf(1.2, size=3000) % 100
    seeds = [package_frequent(theirs).serialize(ds.PyLongsSerDe()), None]
    result = ss.run(ss.from_datasketches(TOPK, seeds, item="long"), x, **RUN)
    union = np.concatenate([x[:, 0], theirs])
    for value, count, error in zip(result.values[0], result.counts[0], result.errors[0], strict=True):
        assert count <= np.sum(union == value) <= count + error
    found, counts = np.unique(union, return_counts=True)
    assert result.values[0, 0] == found[np.argmax(counts)]
    np.testing.assert_array_equal(result.counts[1], plain.counts[1])  # no seed: the run's own
    check_counts(ds.frequent_items_sketch.deserialize(result.to_datasketches()[0], ds.PyLongsSerDe()), union)


def test_mistakes_are_one_line_before_compute(floats):
    x = np.zeros((10, 2), np.int32)
    kll_double = package_kll(ds.kll_doubles_sketch, [0.5, 1.5]).serialize()
    cases = [
        (ss.from_datasketches(QUANTILES, [kll_double], item="double"), "got 1 sketches for data of 2 columns"),
        (ss.from_datasketches(QUANTILES, [kll_double, None], item="double"), "cannot hold exactly"),
        (ss.from_datasketches(QUANTILES, [b"\x01\x02\x03\x04\x05\x06\x07\x08", None], item="float"),
         "not a DataSketches KLL"),
        (ss.from_datasketches(TOPK, [kll_double, None], item="long"), "not a DataSketches Frequent Items"),
    ]
    for combiner, message in cases:
        with pytest.raises(ss.UsageError, match=message):
            ss.run(combiner, x, **RUN)
    for seeded in (ss.from_datasketches(QUANTILES, [kll_double, None], item="double"),
                   ss.from_datasketches(TOPK, [None, None], item="long")):  # omit would skip whole rows: refused
        with pytest.raises(ss.UsageError, match="nan_policy='omit_rows'"):
            ss.run(seeded, x, nan_policy="omit", **RUN)
    with pytest.raises(ss.UsageError, match="datasketches=True"):
        ss.from_datasketches(ss.DistinctCount(), [kll_double])
    with pytest.raises(ss.UsageError, match="lg_k=8 cannot be merged"):
        ss.run(ss.from_datasketches(DISTINCT, [package_hll([1, 2], lg_k=8).serialize_compact(), None]), x, **RUN)
    with pytest.raises(ss.UsageError, match="one serialized sketch"):
        ss.from_datasketches(TOPK, [1, 2])
    with pytest.raises(ss.UsageError, match="holds no sketch"):
        floats[1]._replace(sketch=None).to_datasketches()  # e.g. Quantiles(exact=True)'s


def package_hll(values, lg_k=10, kind=None):
    sketch = ds.hll_sketch(lg_k, kind or ds.tgt_hll_type.HLL_8)
    for v in values:
        sketch.update(v)
    return sketch


def test_datasketches_hash_is_the_packages_for_every_kind_of_value():
    """MurmurHash3 in 32-bit words against the package's own coupons (its LIST form holds them)."""
    def theirs(values):
        out = []
        for v in values:
            (coupon,) = np.frombuffer(package_hll([v], lg_k=21).serialize_compact(), "<u4", 1, 8)
            out.append((int(coupon) & ((1 << 21) - 1), int(coupon) >> 26))
        return out

    def ours(x):
        code = keys.KIND_DTYPES.index(keys.keyed_as(x.dtype))
        index, rank = jax.jit(lambda k: murmur.coupons(k, code, 21))(keys.to_keys(jax.numpy.asarray(x)))
        return list(zip(np.asarray(index).tolist(), np.asarray(rank).tolist(), strict=True))

    floats = np.array([0.0, -0.0, 1.5, -2.25, np.inf, -np.inf, np.nan, 1e-40, -3e-45, 1.17e-38, 3.4e38], np.float32)
    assert ours(floats) == theirs(floats.tolist())
    ints = np.array([0, 1, -1, 2**31 - 1, -(2**31)], np.int32)
    assert ours(ints) == theirs(ints.tolist())
    unsigned = np.array([0, 2**31, 2**32 - 1], np.uint32)
    assert ours(unsigned) == theirs(unsigned.tolist())  # as Python ints: int64 of the value
    with jax.enable_x64(True):
        doubles = np.array([-0.0, np.pi, -1e300, np.nan, 5e-324])
        assert ours(doubles) == theirs(doubles.tolist())
        longs = np.array([-1, 2**62, -(2**63), 2**63 - 1])
        assert ours(longs) == theirs(longs.tolist())


def test_hll_bytes_are_the_packages_registers_and_a_union_counts_the_overlap_once():
    rng = np.random.default_rng(10)
    x = np.stack([rng.integers(-5000, 5000, size=ROWS), rng.integers(0, 3, size=ROWS)], 1).astype(np.int32)
    result = ss.run(DISTINCT, x, **RUN)
    blobs = result.to_datasketches()
    for j, blob in enumerate(blobs):
        same = package_hll(x[:, j].tolist())  # the same values, by the package: the same registers
        np.testing.assert_array_equal(formats.read_hll(blob), formats.read_hll(same.serialize_compact()))
        union = ds.hll_union(10)
        union.update(ds.hll_sketch.deserialize(blob))
        union.update(same)
        assert union.get_estimate() == ds.hll_sketch.deserialize(blob).get_estimate()  # the overlap once
    other = rng.integers(0, 20000, size=3000)
    union = ds.hll_union(10)
    union.update(ds.hll_sketch.deserialize(blobs[0]))
    union.update(package_hll(other.tolist(), kind=ds.tgt_hll_type.HLL_4))
    true = len(np.union1d(x[:, 0], other))
    assert union.get_lower_bound(3) <= true <= union.get_upper_bound(3)
    seeds = [package_hll(other.tolist(), lg_k=12, kind=ds.tgt_hll_type.HLL_4).serialize_compact(), None]
    seeded = ss.run(ss.from_datasketches(DISTINCT, seeds), x, **RUN)  # lg_k 12 folded to 10
    assert abs(seeded.count[0] - true) <= 3 * seeded.relative_error[0] * true and not seeded.exact[0]
    np.testing.assert_array_equal(seeded.count[1], result.count[1])


def test_hll_bytes_read_back_in_every_mode():
    values = np.random.default_rng(11).integers(0, 10**6, size=3000).tolist()
    want = formats.read_hll(package_hll(values).serialize_compact())
    for kind in (ds.tgt_hll_type.HLL_4, ds.tgt_hll_type.HLL_6, ds.tgt_hll_type.HLL_8):
        sketch = package_hll(values, kind=kind)
        for blob in (sketch.serialize_compact(), sketch.serialize_updatable()):
            np.testing.assert_array_equal(formats.read_hll(blob), want)
    few = package_hll(values[:5])  # LIST mode: coupons
    listed = formats.read_hll(few.serialize_compact())
    np.testing.assert_array_equal(formats.read_hll(few.serialize_updatable()), listed)
    assert np.count_nonzero(listed) == 5 and ds.hll_sketch.deserialize(formats.hll_bytes(listed)).get_estimate() > 4.9
    some = package_hll(values[:200])  # SET mode
    np.testing.assert_array_equal(formats.read_hll(some.serialize_compact()), formats.read_hll(
        package_hll(values[:200], kind=ds.tgt_hll_type.HLL_6).serialize_updatable()))
    np.testing.assert_array_equal(formats.fold_registers(formats.read_hll(package_hll(values, 12).serialize_compact()),
                                                         10), want)
    empty = ds.hll_sketch.deserialize(formats.hll_bytes(np.zeros(1024, np.uint8)))
    assert empty.is_empty() and empty.lg_config_k == 10


def test_finding3_a_seeds_item_type_is_named_and_a_mismatch_is_one_line(floats):
    """Finding 3: a kll_ints_sketch read as floats gave a median of 6.2e-43, Frequent Items of longs read into a
    float column 4.94e-322; the bytes hold no item type, so it is named (item=) and checked against their layout."""
    x, _ = floats
    ints = ds.kll_ints_sketch(100)
    theirs = np.random.default_rng(12).integers(-(10**6), 10**6, size=3000)
    for v in theirs.tolist():
        ints.update(v)
    for item, message in ((None, "needs the KLL sketches' item type"), ("double", "4-byte|items")):
        with pytest.raises(ss.UsageError, match=message):
            ss.run(ss.from_datasketches(QUANTILES, [ints.serialize(), None], item=item), x, **ONE)
    result = ss.run(ss.from_datasketches(QUANTILES, [ints.serialize(), None], item="int"), x, **ONE)
    union = np.concatenate([x[:, 0], theirs])  # int32 values float32 holds (|v| < 2^24)
    for q, v in zip(QUANTILES.qs, result.quantiles[0], strict=True):
        assert abs(rank(union, v) - q) <= result.rank_error, q
    assert result.count[0] == ROWS + 3000
    java = package_kll(ds.kll_doubles_sketch, [0.5, 1.5]).serialize()
    java = java[:3] + bytes([java[3] | 8]) + java[4:]  # Java's KllDoublesSketch before 5.0 flags its bytes
    with pytest.raises(ss.UsageError, match="a KllDoublesSketch's .* not a sketch of long items"):
        formats.read_kll(java, "long")
    assert formats.read_kll(java).levels[0].tolist() == [0.5, 1.5]
    longs = package_frequent([2**40, 2**40, 3]).serialize(ds.PyLongsSerDe())
    with pytest.raises(ss.UsageError, match="needs the Frequent Items sketches' item type"):
        ss.from_datasketches(TOPK, [longs, None])
    with pytest.raises(ss.UsageError, match="cannot hold exactly"):  # 2^40 in a float32 column: exact; 2^40+1 not
        ss.run(ss.from_datasketches(TOPK, [package_frequent([2**40 + 1]).serialize(ds.PyLongsSerDe()), None],
                                    item="long"), x, **RUN)
    with pytest.raises(ss.UsageError, match="end inside its strings"):
        formats.read_frequent_items(longs, "string")
    image = formats.read_frequent_items(longs, "long")
    assert sorted(zip(image.items, image.weights.tolist(), strict=True)) == [(3, 1), (2**40, 2)]
    with pytest.raises(ss.UsageError, match="item= one of"):
        ss.from_datasketches(TOPK, [longs, None], item="string")  # string columns take no seeds


def test_finding3_an_item_weight_past_2_63_is_one_line_not_dropped(ints):
    x, _ = ints
    for weights, offset, message in (([2**64 - 5, 3], 0, "an item weight of 18446744073709551611, past 2"),
                                     ([2**61, 3], 2**61, "sum past 2\\^62")):
        blob = formats.frequent_items_bytes([7, 8], weights, offset, 2**63 - 1, 32, "long")
        with pytest.raises(ss.UsageError, match=f"sketch of column 0: .*{message}"):
            ss.run(ss.from_datasketches(TOPK, [blob, None], item="long"), x, **RUN)


def test_finding13_malformed_sketch_bytes_are_one_line_each(ints):
    """Finding 13: cut, crafted and oversized sketch bytes raised struct.error, ValueError, ZeroDivisionError,
    OverflowError or MemoryError (16 TiB for lg_k=44); each is one UsageError line, before any compute."""
    x, _ = ints
    kll = package_kll(ds.kll_doubles_sketch, np.arange(5000.0), k=50).serialize()
    capacity = formats.kll_capacity(50, kll[18])
    frequent = package_frequent(np.arange(300) % 90).serialize(ds.PyLongsSerDe())
    hll = package_hll(range(3000)).serialize_compact()
    cases = [
        (formats.read_kll, kll[:10], "shorter than a full sketch's 20-byte header"),
        (formats.read_kll, kll[:21], "cannot hold the offsets"),
        (formats.read_kll, kll[:20] + struct.pack("<I", capacity + 2) + kll[24:], "out of order or past"),
        (formats.read_frequent_items, frequent[:-5], "bytes cannot hold 6 items"),
        (formats.read_frequent_items, frequent[:24] + struct.pack("<Q", 2**64 - 5000) + frequent[32:], "past 2"),
        (formats.read_hll, hll[:-1], "not the 1064"),
        (formats.read_hll, hll[:3] + bytes([44]) + hll[4:], "lg_k=44, not 4 to 21"),
    ]
    for reader, blob, message in cases:
        with pytest.raises(ss.UsageError, match=message) as e:
            reader(blob, "long") if reader is formats.read_frequent_items else reader(blob)
        assert "\n" not in str(e.value)
    with pytest.raises(ss.UsageError, match="sketch of column 1: .*an offset .* of 18446744073709546616"):
        ss.run(ss.from_datasketches(TOPK, [None, cases[4][1]], item="long"), x, **RUN)  # was: OverflowError at the end


def test_exported_64_bit_values_are_exact_or_one_line():
    """A kll_doubles_sketch holds doubles, DataSketches' longs are signed: an int64 past 2^53 and a uint64 past
    2^63 - 1 went out as other values (the uint64 as its bits, a negative long); now one line each."""
    from sharded_scan.combiners.sketches import seeded
    from sharded_scan.combiners.sketches.topk import TopKResult

    def kll_state(values, dtype):
        code = keys.KIND_DTYPES.index(np.dtype(dtype))
        state = np.zeros(1, formats.kll_state_dtype(np.uint64, 8))
        state["items"][0, :len(values)] = seeded._keys(np.array(values, dtype), code)
        state["sizes"][0, 0], state["kind"], state["k"] = len(values), code, 64
        state["low"], state["high"] = seeded._keys(np.array([min(values), max(values)], dtype), code)
        return state

    exact = ds.kll_doubles_sketch.deserialize(formats.kll_sketches(kll_state([-(2**53), 5, 2**53], np.int64))[0])
    assert (exact.get_min_value(), exact.get_max_value(), exact.n) == (-(2**53), 2**53, 3)
    for values, dtype in (([1, 2**62 + 1], np.int64), ([0, 2**64 - 1], np.uint64)):
        with pytest.raises(ss.UsageError, match="column 0 holds .* no double holds exactly"):
            formats.kll_sketches(kll_state(values, dtype))
    state = np.zeros(1, formats.frequent_state_dtype(np.uint64, 4))
    state["keys"][0, :2], state["counts"][0, :2], state["held"], state["kind"] = [2**64 - 1, 3], [5, 2], 2, 5
    result = TopKResult(np.array([[2**64 - 1, 3]], np.uint64), np.array([[5, 2]]), np.zeros((1, 2), np.int64),
                           np.zeros(1, np.int64), np.ones(1, bool), state)
    with pytest.raises(ss.UsageError, match="column 0 holds 18446744073709551615, past 2\\^63 - 1"):
        result.to_datasketches()
    state["keys"][0, 0] = 2**63 - 1
    image = formats.read_frequent_items(formats.frequent_items_sketches(result)[0], "long")
    assert sorted(image.items) == [3, 2**63 - 1]
