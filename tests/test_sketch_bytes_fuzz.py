"""Every sketch deserializer fuzzed: each reads valid bytes (made by the ``datasketches`` package) as the
package does, and any other bytes (every truncation, each header field at its extremes, single-byte
flips, random bytes) either read as a sketch or raise one ``UsageError`` line: never another exception,
never a hang, never an allocation larger than the bytes justify.

The readers are host numpy, tested directly (milliseconds a case); two cases go end to end through
``from_datasketches`` and ``run``, refused before any compute (no compile). ``HYPOTHESIS_PROFILE=long``
searches the random bytes and edits deeper."""

import functools
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import sharded_scan as ss
from sharded_scan.combiners.sketches import datasketches as formats

ds = pytest.importorskip("datasketches")

RNG = np.random.default_rng(42)
BIG = 6 << 20  # bytes a read may allocate beyond a small multiple of its input: 2 MiB registers (lg_k 21), twice


def _kll(cls, values, k=200, merge=None):
    sketch = cls(k)
    for v in values:
        sketch.update(v)
    for other in merge or ():
        sketch.merge(other)
    return sketch


@functools.cache
def corpus() -> list:
    """(name, reader, blob, item, package sketch or None): every kind and form the readers take."""
    out = []
    floats = RNG.normal(size=3000)
    ints = RNG.integers(-(2**31), 2**31, size=3000)
    for cls, item, values in ((ds.kll_floats_sketch, "float", floats), (ds.kll_doubles_sketch, "double", floats),
                              (ds.kll_ints_sketch, "int", ints)):
        values = values.tolist()
        for name, sketch in (("empty", cls(200)), ("single", _kll(cls, values[:1])), ("small", _kll(cls, values[:30])),
                             ("levels", _kll(cls, values, k=20)),
                             ("merged", _kll(cls, values[:900], k=40, merge=[_kll(cls, values[900:], k=64)]))):
            out.append((f"kll-{item}-{name}", formats.read_kll, sketch.serialize(), item, sketch))
            blob = sketch.serialize()
            if item == "double" and name in ("single", "levels"):  # Java's KllDoublesSketch 4.x (flag 8), 3.x (6 ints)
                out.append((f"kll-{item}-{name}-java4", formats.read_kll, blob[:3] + bytes([blob[3] | 8]) + blob[4:],
                            item, sketch))
                if name == "levels":
                    java3 = bytes([6]) + blob[1:3] + bytes([blob[3] | 8]) + blob[4:20] + bytes(4) + blob[20:]
                    out.append((f"kll-{item}-{name}-java3", formats.read_kll, java3, item, sketch))
    serdes = {"long": ds.PyLongsSerDe(), "double": ds.PyDoublesSerDe(), "int": ds.PyIntsSerDe(),
              "float": ds.PyFloatsSerDe(), "string": ds.PyStringsSerDe()}
    zipf = RNG.zipf(1.3, size=2000) % 700
    for item, serde in serdes.items():
        values = {"long": zipf * 10**12 - 5, "double": zipf / 8, "int": zipf - 300, "float": zipf / 4,
                  "string": np.char.add("s", zipf.astype(str))}[item].tolist()  # PyStringsSerDe: ASCII only
        for name, count, lg in (("empty", 0, 6), ("exact", 40, 6), ("purged", 2000, 4)):
            sketch = ds.frequent_items_sketch(lg)
            for v in values[:count]:
                sketch.update(v)
            out.append((f"fi-{item}-{name}", _reads_frequent, sketch.serialize(serde), item, sketch))
    strings = ds.frequent_strings_sketch(5)  # UTF-8
    for v in np.char.add("é", zipf.astype(str))[:500].tolist():
        strings.update(v)
    out.append(("fi-strings-sketch", _reads_frequent, strings.serialize(), "string", strings))
    for kind in (ds.HLL_4, ds.HLL_6, ds.HLL_8):
        for name, lg_k, count in (("empty", 10, 0), ("list", 10, 5), ("set", 12, 200), ("hll", 10, 3000),
                                  ("aux", 12, 20000), ("small", 4, 5000)):
            sketch = ds.hll_sketch(lg_k, kind)
            for v in range(count):
                sketch.update(v)
            for form, blob in (("compact", sketch.serialize_compact()), ("updatable", sketch.serialize_updatable())):
                out.append((f"hll-{kind.name}-{name}-{form}", formats.read_hll, blob, None, (lg_k, count)))
    return out


def _reads_frequent(blob, item):
    return formats.read_frequent_items(blob, item)


def read(reader, blob, item):
    """The reader's outcome: what it read, or the UsageError's line; any other exception fails the test."""
    try:
        return reader(blob, item) if item is not None else reader(blob)
    except ss.UsageError as e:
        message = str(e)
        assert "\n" not in message and message, message
        return e


def bounded_read(reader, blob, item):
    """:func:`read`, its allocations traced: no more than the bytes justify."""
    tracemalloc.start()
    try:
        outcome = read(reader, blob, item)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= BIG + 64 * len(blob), (len(blob), peak)
    return outcome


@functools.cache
def hll_registers(lg_k: int, count: int) -> np.ndarray:
    sketch = ds.hll_sketch(lg_k, ds.HLL_8)
    for v in range(count):
        sketch.update(v)
    return formats.read_hll(sketch.serialize_compact())


def test_valid_bytes_read_as_the_package_reads_them():
    for name, reader, blob, item, sketch in corpus():
        image = read(reader, blob, item)
        assert not isinstance(image, ss.UsageError), (name, image)
        if name.startswith("kll"):
            assert image.n == sketch.n and image.k == sketch.k, name
            assert sum(len(level) for level in image.levels) == sketch.num_retained, name
            if image.n:
                assert (image.min, image.max) == (sketch.get_min_value(), sketch.get_max_value()), name
                assert all(level.dtype == (np.int64 if item == "int" else np.float64) for level in image.levels)
                for q in (0.1, 0.5, 0.9):  # the package's quantile is one of the items read
                    assert any(sketch.get_quantile(q) in level for level in image.levels), (name, q)
        elif name.startswith("fi"):
            rows = sketch.get_frequent_items(ds.frequent_items_error_type.NO_FALSE_NEGATIVES, 0)
            want = sorted((v, lower) for v, _, lower, _ in rows)
            assert sorted(zip(image.items, image.weights.tolist(), strict=True)) == want, name
            assert image.offset == sketch.get_upper_bound("never") and image.total_weight == sketch.total_weight, name
        else:  # every kind and mode holds the registers of the package's own HLL_8
            np.testing.assert_array_equal(image, hll_registers(*sketch), err_msg=name)
    assert any(struct.unpack_from("<I", blob, 36)[0] for name, _, blob, _, _ in corpus() if "HLL_4-aux" in name)


def test_every_truncation_is_one_line_or_a_sketch():
    for name, reader, blob, item, _ in corpus():
        refused = sum(isinstance(read(reader, blob[:cut], item), ss.UsageError) for cut in range(len(blob)))
        if not name.startswith("hll") or "updatable" not in name:  # an empty updatable HLL cut to 8: an empty one
            assert refused == len(blob), name


def _fields(name: str, blob: bytes) -> list:
    """(offset, width) of each header field of ``blob``'s layout."""
    head = [(0, 1), (1, 1), (2, 1), (3, 1)]
    if name.startswith("kll"):
        return head + [(4, 2), (6, 1), (7, 1)] + ([(8, 8), (16, 2), (18, 1), (19, 1)] + [
            (4 * blob[0] + 4 * h, 4) for h in range(blob[18])] if blob[0] in (5, 6) else [])
    if name.startswith("fi"):
        return head + [(4, 1), (5, 1), (6, 2)] + ([(8, 4), (12, 4), (16, 8), (24, 8)] if blob[0] == 4 else [])
    fields = head + [(4, 1), (5, 1), (6, 1), (7, 1)]
    if blob[7] & 3 == formats.SET:
        fields.append((8, 4))
    if blob[7] & 3 == formats.HLL:
        fields += [(8, 8), (16, 8), (24, 8), (32, 4), (36, 4)]
    return fields


EDGES = (3, 4, 5, 6, 7, 8, 9, 10, 15, 16, 21, 22, 26, 27, 31, 32, 47, 48, 49, 63, 64, 65)  # 1-byte ranges' ends


def _extremes(value: int, width: int) -> set:
    top = (1 << 8 * width) - 1
    return {v for v in (0, 1, 2, top, top - 1, top >> 1, (top >> 1) + 1, value - 1, value + 1, value + 2, value * 2,
                        value + 5000, top - 5000, *(EDGES if width == 1 else ())) if 0 <= v <= top}


def test_each_header_field_at_its_extremes_is_one_line_or_a_sketch():
    cases = 0
    for name, reader, blob, item, _ in corpus():
        for at, width in _fields(name, blob):
            value = int.from_bytes(blob[at: at + width], "little")
            for v in _extremes(value, width):
                edited = blob[:at] + v.to_bytes(width, "little") + blob[at + width:]
                bounded_read(reader, edited, item)
                cases += 1
    assert cases > 2000


def test_single_byte_flips_are_one_line_or_a_sketch():
    for _, reader, blob, item, _ in corpus():
        at = np.arange(len(blob)) if len(blob) <= 300 else np.unique(RNG.integers(0, len(blob), 300))
        for i, mask in zip(at.tolist(), RNG.integers(1, 256, len(at)).tolist(), strict=True):
            read(reader, blob[:i] + bytes([blob[i] ^ mask]) + blob[i + 1:], item)


READERS = [("kll", formats.read_kll, item) for item in formats.KLL_ITEMS] + [
    ("fi", _reads_frequent, item) for item in formats.FREQUENT_ITEMS] + [("hll", formats.read_hll, None)]
FAMILY = {"kll": formats.KLL_FAMILY, "fi": formats.FI_FAMILY, "hll": formats.HLL_FAMILY}


@given(st.sampled_from(READERS), st.binary(min_size=0, max_size=600), st.integers(0, 255))
def test_random_bytes_are_one_line_or_a_sketch(reader, blob, pre):
    kind, fn, item = reader
    if len(blob) >= 3:  # the family right, so the bytes reach past the first check
        blob = bytes([pre]) + blob[1:2] + bytes([FAMILY[kind]]) + blob[3:]
    bounded_read(fn, blob, item)


@given(st.integers(0, len(corpus()) - 1), st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)),
                                                   min_size=1, max_size=6))
def test_edited_valid_bytes_are_one_line_or_a_sketch(which, edits):
    name, reader, blob, item, _ = corpus()[which]
    edited = bytearray(blob)
    for at, value in edits:
        edited[at % len(edited)] = value
    bounded_read(reader, bytes(edited), item)


def test_malformed_seeds_are_one_line_through_run_before_compute():
    x = np.zeros((8, 1), np.float32)
    kll = next(blob for name, _, blob, _, _ in corpus() if name == "kll-double-levels")
    with pytest.raises(ss.UsageError, match="sketch of column 0: .*KLL sketch bytes are malformed") as e:
        ss.run(ss.from_datasketches(ss.Quantiles(qs=[0.5], k=64), [kll[:-3]], item="double"), x, mesh="data:1")
    assert "\n" not in str(e.value)
    hll = next(blob for name, _, blob, _, _ in corpus() if name == "hll-HLL_8-hll-compact")
    with pytest.raises(ss.UsageError, match="lg_k=44"):
        ss.run(ss.from_datasketches(ss.DistinctCount(precision=8, datasketches=True), [hll[:3] + b"\x2c" + hll[4:]]),
               x, mesh="data:1")
