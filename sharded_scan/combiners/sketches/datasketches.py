"""Apache DataSketches' binary sketches of the quantile and frequency sketches, written and read.

Spark, Druid, Pinot, Postgres and DuckDB merge DataSketches' serialized sketches; the
``datasketches`` Python package reads the same bytes. This module writes, per column:

- a **KLL** sketch (``kll_floats_sketch`` for float32 columns, ``kll_doubles_sketch`` for the
  others) of a :class:`~sharded_scan.Quantiles` sketch: our levels are KLL's (an item at level
  ``h`` stands for ``2^h`` rows, each level sorted, level capacities ``k (2/3)^depth``, at least
  8, no larger than DataSketches' rounded ones), so the items go across level by level, every
  rank, the minimum and the maximum kept exactly. ``n`` is the items' total weight, as
  DataSketches requires (its merge checks it): the rows, but for the roundings of the sketch's
  sampled inserts (``|n - rows| / rows`` within the result's ``rank_error``). NaN items are left
  out, as DataSketches ignores NaN.
- a **Frequent Items** sketch (``frequent_items_sketch`` with ``PyLongsSerDe`` for integer
  columns, ``PyDoublesSerDe`` for floats; ``frequent_strings_sketch`` for string columns) of a
  :class:`~sharded_scan.TopK` summary: every monitored value with its exact ``count`` as its
  weight, and as the sketch's offset (its maximum error) the largest slack, at least ``D``, the
  bound on any unmonitored value; so DataSketches' bounds ``[weight, weight + offset]`` hold
  every true count. ``total_weight`` is the rows of the monitored values (TopK keeps no row count).
  A string column's sketch lists the ``k`` values the result lists, with the result's ``bound``
  as offset (the other monitored values are hash ids, not strings).

- an **HLL** sketch (``hll_sketch``, HLL_8) of a ``DistinctCount(datasketches=True)``'s registers,
  which hash values as DataSketches does (:mod:`~.murmur`); so a union with DataSketches' own
  sketches of overlapping values counts the overlap once.

and reads them back (:func:`read_kll`, :func:`read_frequent_items`, :func:`read_hll`: its LIST,
SET, HLL_4, HLL_6 and HLL_8 forms), what
:func:`~sharded_scan.from_datasketches` merges into a run. The readers take any bytes: every header
field is checked and every count it implies is bounded by the bytes left before anything is read or
allocated, so malformed, truncated or crafted bytes are one ``UsageError`` line (fuzzed in
``tests/test_sketch_bytes_fuzz.py``). KLL and Frequent Items bytes do not name their item type
(:data:`ITEMS`), so the caller does; their lengths (and Java's KLL flags) are checked against it.
Written values no DataSketches item holds (an integer past 2^53 as a KLL double, a uint64 past
2^63 - 1 as a long) are one line too. Layouts: datasketches-cpp
``kll_sketch_impl.hpp`` (serial versions 1 and 2), ``frequent_items_sketch_impl.hpp`` and ``hll/``
(``HllArray``, ``CouponList``, ``Hll4Array``).
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import numpy as np

from sharded_scan.combiners import wide
from sharded_scan.combiners.sketches import kll
from sharded_scan.combiners.sketches.keys import KIND_DTYPES, decode, is_float, nan_key
from sharded_scan.errors import UsageError

KLL_FAMILY, KLL_M, KLL_MAX_K = 15, 8, (1 << 16) - 1
KLL_EMPTY, KLL_LEVEL_ZERO_SORTED, KLL_SINGLE_ITEM = 1, 2, 4  # flag bits
KLL_DOUBLES, KLL_UPDATABLE = 8, 16  # Java's before 5.0: a KllDoublesSketch's bytes; an updatable layout
FI_FAMILY, FI_EMPTY = 10, 1 | 4  # DataSketches sets both of its empty bits
FI_LOAD_FACTOR = 0.75


def kll_state_dtype(key_type, slots: int) -> np.dtype:
    """One column's quantile sketch as a record (``QuantilesResult.sketch``: one a column): what its KLL bytes hold."""
    return np.dtype([
        ("items", key_type, (slots,)),     # keys: level 0 first, each level sorted; the filler after
        ("sizes", np.int32, (kll.LEVELS,)),  # items per level
        ("low", key_type), ("high", key_type),  # the smallest and largest key (keys.nan_key once a NaN was seen)
        ("kind", np.int32), ("k", np.int64),    # keys.kind_code; the sketch size
    ])


def frequent_state_dtype(key_type, capacity: int) -> np.dtype:
    """One column's frequency summary as a record (``TopKResult.sketch``): what its Frequent Items bytes hold."""
    return np.dtype([
        ("keys", key_type, (capacity,)),      # the first ``held`` are monitored
        ("counts", np.int64, (capacity,)),    # rows counted, at most the true count
        ("slacks", np.int64, (capacity,)),    # the true count is at most count + slack
        ("held", np.int64), ("offset", np.int64),  # monitored values; D: no unmonitored value has more rows
        ("kind", np.int32),
    ])


# ---- KLL -------------------------------------------------------------------------------------

def _cap_aux(k: int, depth: int) -> int:
    if depth > 30:
        half = depth // 2
        return _cap_aux(_cap_aux(k, half), depth - half)
    return (((2 * k) << depth) // 3**depth + 1) >> 1  # k (2/3)^depth, rounded


def kll_capacity(k: int, num_levels: int) -> int:
    """DataSketches' total capacity of a KLL sketch of ``num_levels`` levels (``compute_total_capacity``)."""
    return sum(max(KLL_M, _cap_aux(k, num_levels - h - 1)) for h in range(num_levels))


class KllImage(NamedTuple):
    """A KLL sketch as its bytes hold it: per level the items (sorted above level 0), ``n``, min and max."""

    k: int
    min_k: int
    n: int
    levels: list          # float64 arrays, level 0 first
    min: float
    max: float
    itemsize: int         # 4: kll_floats_sketch, 8: kll_doubles_sketch


def kll_bytes(levels: list, k: int, low: float, high: float, itemsize: int) -> bytes:
    """A KLL sketch's bytes (``kll_floats_sketch`` for ``itemsize`` 4, ``kll_doubles_sketch`` for 8).

    Args:
      levels: per level, level 0 first, the items (float64 arrays, each sorted); level ``h`` weighs ``2^h``.
      k: the sketch's ``k`` (and ``min_k``), 8 to 65535.
      low, high: the smallest and largest value summarized.
      itemsize: 4 (float32 items) or 8 (float64).
    """
    fmt = "<f" if itemsize == 4 else "<d"
    while levels and len(levels[-1]) == 0:
        levels = levels[:-1]
    n = sum(len(items) << h for h, items in enumerate(levels))
    if n == 0:
        return struct.pack("<BBBBHBB", 2, 1, KLL_FAMILY, KLL_EMPTY, k, KLL_M, 0)
    if n == 1:
        return struct.pack("<BBBBHBB", 2, 2, KLL_FAMILY, KLL_SINGLE_ITEM, k, KLL_M, 0) + struct.pack(fmt, levels[0][0])
    capacity = kll_capacity(k, len(levels))
    retained = sum(len(items) for items in levels)
    if retained > capacity:  # never for a Quantiles sketch: each level holds fewer than its capacity
        raise UsageError(f"the sketch holds {retained} items, more than a KLL sketch of k={k} holds ({capacity}).")
    offsets = np.cumsum([capacity - retained] + [len(items) for items in levels[:-1]])
    items = np.concatenate(levels).astype(fmt)
    return b"".join([
        struct.pack("<BBBBHBB", 5, 1, KLL_FAMILY, KLL_LEVEL_ZERO_SORTED, k, KLL_M, 0),
        struct.pack("<QHBB", n, k, len(levels), 0), offsets.astype("<u4").tobytes(),
        np.array([low, high], fmt).tobytes(), items.tobytes(),
    ])


def read_kll(blob: bytes, item: str | None = None) -> KllImage:
    """The levels, ``n``, min and max of a KLL sketch's bytes, its items of type ``item`` (:data:`ITEMS`: ``"float"``
    for ``kll_floats_sketch``, ``"double"``, ``"int"`` for ``kll_ints_sketch``, ``"long"``; None: ``"float"`` or
    ``"double"`` by the bytes' length). Integer items come back as int64 (levels) and ints (min, max), exactly.

    Every header field is checked, and every size it implies is checked against the bytes' length before
    anything is read: malformed, truncated or crafted bytes are one :class:`UsageError` line.
    """
    blob = bytes(blob)
    if len(blob) >= 3 and blob[2] != KLL_FAMILY:
        raise UsageError("these bytes are not a DataSketches KLL sketch (family 15); pass what a "
                         "kll_floats_sketch or kll_doubles_sketch's serialize() returned.")
    _need(len(blob) >= 8, "KLL", f"its {len(blob)} bytes are shorter than its 8-byte header")
    pre_ints, version, _, flags, k, m, _ = struct.unpack_from("<BBBBHBB", blob)
    _need(version in (1, 2), "KLL", f"serial version {version}: 1 and 2 are compact bytes (pass serialize()'s "
          "or Java's toByteArray()'s, not an updatable form)")
    _need(m == KLL_M, "KLL", f"m={m}, not {KLL_M}")
    _need(k >= KLL_M, "KLL", f"k={k}, below the smallest k ({KLL_M})")
    size = None if item is None else _item_size(item, KLL_ITEMS, "a KLL sketch")
    _need(not flags & KLL_UPDATABLE, "KLL", "an updatable sketch's bytes (flag 16); pass its compact bytes")
    if flags & KLL_DOUBLES:  # Java's KllDoublesSketch before 5.0 says so (its full preamble: 5 ints, or 6 before 4.0)
        if item not in (None, "double"):
            raise UsageError(f"these KLL sketch bytes are a KllDoublesSketch's (their flags say so), not a sketch of "
                             f"{item} items; pass item='double'.")
        size = 8
    empty, single = bool(flags & KLL_EMPTY), bool(flags & KLL_SINGLE_ITEM)
    full = (5, 6) if flags & KLL_DOUBLES else (5,)
    _need(pre_ints in ((2,) if empty or single else full), "KLL", f"{pre_ints} preamble ints with flags {flags}")
    if empty:
        _need(len(blob) == 8, "KLL", f"an empty sketch of {len(blob)} bytes, not 8")
        return KllImage(k, k, 0, [], math.nan, math.nan, size or 8)
    if single:
        size = size or len(blob) - 8
        _need(len(blob) == 8 + size and size in (4, 8), "KLL",
              f"a one-item sketch of {len(blob)} bytes, not {8 + size} (a header and one {_name(item, size)})")
        values = _values(blob, item, size, 1, 8)
        _check_items(values, "KLL")
        return KllImage(k, k, 1, [values], values[0].item(), values[0].item(), size)
    _need(len(blob) >= 20, "KLL", f"its {len(blob)} bytes are shorter than a full sketch's 20-byte header")
    n, min_k, num_levels, _ = struct.unpack_from("<QHBB", blob, 8)
    _need(KLL_M <= min_k <= k, "KLL", f"min_k={min_k}, not between {KLL_M} and k={k}")
    _need(1 <= num_levels <= kll.LEVELS, "KLL", f"{num_levels} levels, not 1 to {kll.LEVELS}")
    start = 4 * pre_ints + 4 * num_levels
    _need(len(blob) >= start, "KLL", f"its {len(blob)} bytes cannot hold the offsets of its {num_levels} levels")
    capacity = kll_capacity(k, num_levels)
    bounds = np.append(np.frombuffer(blob, "<u4", num_levels, 4 * pre_ints).astype(np.int64), capacity)
    _need(bool(np.all(np.diff(bounds) >= 0)) and bounds[0] < capacity, "KLL",
          f"level offsets {bounds[:-1].tolist()} out of order or past its capacity ({capacity})")
    retained = capacity - int(bounds[0])
    if size is None:  # floats or doubles, by the length
        size = (len(blob) - start) // (retained + 2)
    _need(size in (4, 8) and len(blob) == start + size * (retained + 2), "KLL",
          f"{len(blob)} bytes, not the {start + (size if size in (4, 8) else 8) * (retained + 2)} of a header, "
          f"min, max and {retained} {_name(item, size)} items")
    values = _values(blob, item, size, retained + 2, start)
    _check_items(values, "KLL")
    bounds = bounds - bounds[0]
    levels = [np.sort(values[2 + bounds[h]: 2 + bounds[h + 1]]) for h in range(num_levels)]
    weight = sum(len(items) << h for h, items in enumerate(levels))
    _need(n == weight, "KLL", f"n={n}, not its items' total weight ({weight})")
    low, high = values[0].item(), values[1].item()
    _need(low <= values[2:].min() and values[2:].max() <= high, "KLL",
          f"items outside its min ({low}) and max ({high})")
    return KllImage(k, min_k, n, levels, low, high, size)


ITEMS = {"int": "<i4", "long": "<i8", "float": "<f4", "double": "<f8", "string": None}
"""A sketch's item types: DataSketches' ``kll_ints_sketch``/``PyIntsSerDe`` (int32), Java's ``KllLongsSketch``/
``PyLongsSerDe`` (int64), ``kll_floats_sketch``/``PyFloatsSerDe``, ``kll_doubles_sketch``/``PyDoublesSerDe``,
``frequent_strings_sketch``/``PyStringsSerDe`` (UTF-8); by their bytes' layout."""
KLL_ITEMS = ("float", "double", "int", "long")
FREQUENT_ITEMS = ("long", "double", "int", "float", "string")


def _need(condition, sketch: str, what: str) -> None:
    if not condition:
        raise UsageError(f"these {sketch} sketch bytes are malformed or truncated: {what}; pass the bytes a "
                         "DataSketches sketch's serialize() returned, whole.")


def _item_size(item, allowed: tuple, sketch: str) -> int | None:
    if item not in allowed:
        raise UsageError(f"{sketch} of {item!r} items cannot be read; name its item type as one of {allowed}.")
    return None if ITEMS[item] is None else int(ITEMS[item][2:])


def _name(item, size) -> str:
    return item if item is not None else {4: "float", 8: "double"}.get(size, "4- or 8-byte")


def _values(blob: bytes, item, size: int, count: int, at: int) -> np.ndarray:
    """``count`` items of ``item`` (None: floats of ``size`` bytes) at byte ``at``: int64 or float64."""
    dtype = ITEMS[item] if item is not None else ("<f4" if size == 4 else "<f8")
    values = np.frombuffer(blob, dtype, count, at)
    with np.errstate(invalid="ignore"):  # a signaling NaN's cast (then refused as NaN)
        return values.astype(np.int64 if values.dtype.kind == "i" else np.float64)


def _check_items(values: np.ndarray, sketch: str) -> None:
    _need(values.dtype.kind == "i" or not np.isnan(values).any(), sketch, "a NaN item (DataSketches keeps none)")


def kll_rank_error(k: int) -> float:
    """DataSketches' normalized rank error of one quantile of a KLL sketch of ``k`` (99% confidence)."""
    return 2.296 / k**0.9723


def kll_state(acc, k: int) -> np.ndarray:
    """The records (:func:`kll_state_dtype`) of a merged host ``QuantilesAcc``: ``(d,)`` (``()``: rows of one value)."""
    items = np.asarray(acc.sketch.items)
    state = np.zeros(items.shape[0], kll_state_dtype(items.dtype, items.shape[1]))
    state["items"], state["sizes"] = items, np.asarray(acc.sketch.sizes)
    state["low"], state["high"] = np.asarray(acc.low).reshape(-1), np.asarray(acc.high).reshape(-1)
    state["kind"], state["k"] = np.asarray(acc.kind), k
    return state.reshape(np.shape(acc.low))


def kll_sketches(state: np.ndarray | None) -> list[bytes]:
    """Per column, the KLL bytes of a quantile sketch's records (see the module docstring)."""
    if state is None:
        raise UsageError("this QuantilesResult holds no sketch (an exact=True, weighted or Describe result); run "
                         "Quantiles(exact=False) to get one that to_datasketches() can write.")
    out = []
    for column in np.atleast_1d(state):
        k, code = int(column["k"]), int(column["kind"])
        if k > KLL_MAX_K:
            raise UsageError(f"a DataSketches KLL sketch has k <= {KLL_MAX_K}; run Quantiles(k=...) with k at most "
                             f"that (this one has k={k}).")
        floats, itemsize = is_float(code), 4 if KIND_DTYPES[code] == np.float32 else 8
        starts = np.concatenate([[0], np.cumsum(column["sizes"])])
        levels = []
        for h in range(kll.LEVELS):
            keys = column["items"][starts[h]:starts[h + 1]]
            if floats:
                keys = keys[keys != nan_key(keys.dtype)]  # DataSketches ignores NaN
            levels.append(decode(keys, code))
        kept = np.concatenate(levels)
        low, high = decode(column["low"], code), column["high"]  # (an empty column's are not written)
        high = kept.max(initial=-math.inf) if floats and high == nan_key(high.dtype) else decode(high, code)
        if len(kept) and not floats:  # kll_doubles_sketch's items: every integer kept must be a double exactly
            _exact_doubles(np.concatenate([kept, [low, high]]).astype(kept.dtype), len(out))
        levels = [items.astype(np.float64) for items in levels]
        out.append(kll_bytes(levels, k, float(low), float(high), itemsize))
    return out


def _exact_doubles(values: np.ndarray, column: int) -> None:
    """One line when an integer of ``values`` has no float64 of its own (past 2^53): a kll_doubles_sketch would
    hold another value."""
    doubles = values.astype(np.float64)
    fits = doubles < float(np.iinfo(values.dtype).max) + 1.0  # the first double past the type's largest
    exact = fits & (np.where(fits, doubles, 0).astype(values.dtype) == values)
    if not exact.all():
        raise UsageError(f"column {column} holds {values[~exact][0]}, which no double holds exactly, so no "
                         "kll_doubles_sketch of it keeps its values; its quantiles are in the result (to_datasketches "
                         "writes integer columns whose values are within 2^53).")


# ---- Frequent Items ----------------------------------------------------------------------------

class FrequentImage(NamedTuple):
    """A Frequent Items sketch as its bytes hold it."""

    items: list        # the items (int, float or str)
    weights: np.ndarray  # int64: each item's counted weight
    offset: int        # the maximum error: true counts lie in [weight, weight + offset]
    total_weight: int
    lg_max_size: int


def _lg_map_size(capacity: int) -> int:
    """The smallest map (``2^lg``, at least 8) whose load (``3/4``) holds ``capacity`` items."""
    return max(3, math.ceil(math.log2(max(capacity, 1) / FI_LOAD_FACTOR)))


def frequent_items_bytes(items: list, weights, offset: int, total_weight: int, capacity: int, item: str) -> bytes:
    """A Frequent Items sketch's bytes.

    Args:
      items: the items; ``item`` says how they are written: ``"long"`` (int64, ``PyLongsSerDe``),
        ``"double"`` (``PyDoublesSerDe``) or ``"string"`` (``frequent_strings_sketch``).
      weights: each item's weight (> 0).
      offset: the maximum error of every estimate.
      total_weight: the stream's weight.
      capacity: how many items the sketch must be able to hold (sets its map size).
    """
    lg = _lg_map_size(max(capacity, len(items)))
    if not len(items):
        return struct.pack("<BBBBBBH", 1, 1, FI_FAMILY, lg, lg, FI_EMPTY, 0)
    if item == "string":
        encoded = [s.encode() for s in items]
        payload = b"".join(struct.pack("<I", len(e)) + e for e in encoded)
    else:
        payload = np.asarray(items).astype("<q" if item == "long" else "<d").tobytes()
    return b"".join([
        struct.pack("<BBBBBBH", 4, 1, FI_FAMILY, lg, lg, 0, 0),
        struct.pack("<IIQQ", len(items), 0, total_weight, offset),
        np.asarray(weights, "<u8").tobytes(), payload,
    ])


def read_frequent_items(blob: bytes, item: str) -> FrequentImage:
    """The items, weights and offset of a Frequent Items sketch's bytes, its items of type ``item`` (:data:`ITEMS`:
    ``"long"`` for ``PyLongsSerDe``, ``"double"``, ``"int"``, ``"float"``, ``"string"``), checked as :func:`read_kll`'s;
    a weight, offset or total weight past ``2^63 - 1`` is one line."""
    blob = bytes(blob)
    if len(blob) >= 3 and blob[2] != FI_FAMILY:
        raise UsageError("these bytes are not a DataSketches Frequent Items sketch (family 10); pass what a "
                         "frequent_items_sketch or frequent_strings_sketch's serialize() returned.")
    size = _item_size(item, FREQUENT_ITEMS, "a Frequent Items sketch")
    _need(len(blob) >= 8, "Frequent Items", f"its {len(blob)} bytes are shorter than its 8-byte header")
    pre_longs, version, _, lg_max, lg_cur, flags = blob[0] & 0x3F, blob[1], blob[2], blob[3], blob[4], blob[5]
    _need(version == 1, "Frequent Items", f"serial version {version}, not 1")
    _need(3 <= lg_cur <= lg_max, "Frequent Items", f"map sizes 2^{lg_cur} (current) and 2^{lg_max} (largest)")
    if flags & FI_EMPTY:
        _need(pre_longs == 1 and len(blob) == 8, "Frequent Items", f"an empty sketch of {len(blob)} bytes")
        return FrequentImage([], np.zeros(0, np.int64), 0, 0, lg_max)
    _need(pre_longs == 4 and len(blob) >= 32, "Frequent Items",
          f"{pre_longs} preamble longs and {len(blob)} bytes, not 4 and a 32-byte header")
    n, _, total, offset = struct.unpack_from("<IIQQ", blob, 8)
    start = 32 + 8 * n
    _need(len(blob) >= start + (size or 4) * n, "Frequent Items",
          f"its {len(blob)} bytes cannot hold {n} items' weights and {item} items")
    weights = np.frombuffer(blob, "<u8", n, 32)
    _need(n == 0 or weights.min() > 0, "Frequent Items", "an item of weight 0")
    for what, weight in (("an item weight", int(weights.max(initial=0))), ("a total weight", total),
                         ("an offset (maximum error)", offset)):
        if weight > WEIGHT_MAX:
            raise UsageError(f"a Frequent Items sketch holds {what} of {weight}, past 2^63 - 1, which no count here "
                             "holds exactly; split the stream it summarizes.")
    weights = weights.astype(np.int64)
    _need(sum(weights.tolist()) <= total, "Frequent Items",
          f"item weights summing to more than its total weight ({total})")
    if item == "string":
        items = []
        for _ in range(n):
            _need(len(blob) >= start + 4, "Frequent Items", f"its {len(blob)} bytes end inside its strings")
            (length,) = struct.unpack_from("<I", blob, start)
            _need(len(blob) >= start + 4 + length, "Frequent Items", f"its {len(blob)} bytes end inside its strings")
            try:
                items.append(blob[start + 4: start + 4 + length].decode())
            except UnicodeDecodeError as e:
                raise UsageError(f"these Frequent Items sketch bytes are malformed: a string item is not UTF-8 "
                                 f"({e.reason}); pass a frequent_strings_sketch's serialize() bytes, whole.") from None
            start += 4 + length
        _need(start == len(blob), "Frequent Items", f"{len(blob) - start} bytes after its {n} strings")
    else:
        _need(len(blob) == start + size * n, "Frequent Items",
              f"{len(blob)} bytes, not the {start + size * n} of {n} {item} items (of {size} bytes)")
        items = _values(blob, item, size, n, start).tolist()
    return FrequentImage(items, weights, int(offset), int(total), lg_max)


WEIGHT_MAX = (1 << 63) - 1


def frequent_state(acc) -> np.ndarray:
    """The records (:func:`frequent_state_dtype`) of a merged host ``TopKAcc``: ``(d,)`` (``()``: rows of one value)."""
    keys = np.asarray(acc.keys)
    state = np.zeros(keys.shape[0], frequent_state_dtype(keys.dtype, keys.shape[1]))
    state["keys"], state["kind"] = keys, np.asarray(acc.kind)
    state["counts"], state["slacks"] = wide.to_int(acc.count), wide.to_int(acc.slack)
    state["held"], state["offset"] = np.asarray(acc.held).reshape(-1), wide.to_int(acc.bound).reshape(-1)
    return state.reshape(np.shape(acc.held))


def item_kind(code) -> str:
    """How values of key kind ``code`` are written in a Frequent Items sketch: ``"double"`` or ``"long"``."""
    return "double" if is_float(code) else "long"


def frequent_items_sketches(result) -> list[bytes]:
    """Per column, the Frequent Items bytes of a ``TopKResult`` (see the module docstring)."""
    if result.sketch is None:
        raise UsageError("this TopKResult holds no sketch; run TopK to get one that to_datasketches() can write.")
    values, counts, bound = np.atleast_2d(result.values), np.atleast_2d(result.counts), np.atleast_1d(result.bound)
    out = []
    for j, column in enumerate(np.atleast_1d(result.sketch)):
        capacity = column["keys"].shape[0]
        if values.dtype.kind in "UO":  # strings: the listed values, the result's bound as offset
            listed = counts[j] > 0
            out.append(frequent_items_bytes(values[j][listed].tolist(), counts[j][listed], int(bound[j]),
                                            int(counts[j].sum()), capacity, "string"))
            continue
        held = int(column["held"])
        weights, slacks = column["counts"][:held], column["slacks"][:held]
        offset = int(max(column["offset"], slacks.max(initial=0)))
        values = decode(column["keys"][:held], column["kind"])
        if values.dtype == np.uint64 and np.any(values > WEIGHT_MAX):  # PyLongsSerDe's longs are signed
            raise UsageError(f"column {j} holds {values[values > WEIGHT_MAX][0]}, past 2^63 - 1, which no DataSketches "
                             "long holds (a frequent_items_sketch of PyLongsSerDe would read another value); its "
                             "counts are in the result.")
        out.append(frequent_items_bytes(values, weights, offset, int(weights.sum()), capacity,
                                        item_kind(column["kind"])))
    return out


# ---- HLL ---------------------------------------------------------------------------------------

HLL_FAMILY, HLL_EMPTY, HLL_COMPACT, HLL_OUT_OF_ORDER = 7, 4, 8, 16
LIST, SET, HLL = 0, 1, 2  # modes
HLL_4, HLL_6, HLL_8 = 0, 1, 2  # target types
AUX_TOKEN = 15


def hll_state_dtype(m: int) -> np.dtype:
    """One column's distinct-count registers as a record (``DistinctCountResult.sketch``)."""
    return np.dtype([("registers", np.uint8, (m,))])


def hll_state(registers: np.ndarray) -> np.ndarray:
    """The records of host registers ``(d, m)``."""
    state = np.zeros(registers.shape[0], hll_state_dtype(registers.shape[1]))
    state["registers"] = registers
    return state


def hll_bytes(registers: np.ndarray) -> bytes:
    """An HLL_8 sketch's bytes of ``2^lg_k`` registers (values 0..63), marked out of order (a union's:
    DataSketches estimates it from the registers alone)."""
    registers = np.asarray(registers, np.uint8)
    lg_k = int(registers.shape[0]).bit_length() - 1
    if not registers.any():
        return struct.pack("<BBBBBBBB", 2, 1, HLL_FAMILY, lg_k, 3, HLL_EMPTY | HLL_COMPACT, 0, LIST | HLL_8 << 2)
    inverse = np.exp2(-registers.astype(np.float64))
    kxq0, kxq1 = inverse[registers < 32].sum(), inverse[registers >= 32].sum()
    return b"".join([
        struct.pack("<BBBBBBBB", 10, 1, HLL_FAMILY, lg_k, 0, HLL_OUT_OF_ORDER, 0, HLL | HLL_8 << 2),
        struct.pack("<dddII", 0.0, kxq0, kxq1, int(np.sum(registers == 0)), 0), registers.tobytes(),
    ])


HLL_MIN_LG_K, HLL_MAX_LG_K = 4, 21
HLL_PRE_INTS = {LIST: 2, SET: 3, HLL: 10}


def read_hll(blob: bytes) -> np.ndarray:
    """The ``2^lg_k`` registers (uint8) of an HLL sketch's bytes, in any of its modes and types, checked as
    :func:`read_kll`'s (``lg_k`` 4 to 21, as DataSketches: at most 2 MiB of registers)."""
    blob = bytes(blob)
    if len(blob) >= 3 and blob[2] != HLL_FAMILY:
        raise UsageError("these bytes are not a DataSketches HLL sketch (family 7); pass what an hll_sketch's "
                         "serialize_compact() or serialize_updatable() returned.")
    _need(len(blob) >= 8, "HLL", f"its {len(blob)} bytes are shorter than its 8-byte header")
    pre_ints, version, _, lg_k, lg_arr, flags, byte6, mode = blob[:8]
    _need(version == 1, "HLL", f"serial version {version}, not 1")
    _need(HLL_MIN_LG_K <= lg_k <= HLL_MAX_LG_K, "HLL", f"lg_k={lg_k}, not {HLL_MIN_LG_K} to {HLL_MAX_LG_K}")
    cur, kind = mode & 3, (mode >> 2) & 3
    _need(cur in HLL_PRE_INTS and kind in (HLL_4, HLL_6, HLL_8), "HLL", f"mode byte {mode}")
    _need(pre_ints == HLL_PRE_INTS[cur], "HLL", f"{pre_ints} preamble ints in mode {cur}")
    m = 1 << lg_k
    compact = bool(flags & HLL_COMPACT)
    if cur != HLL:  # LIST or SET: coupons (26 bits of slot, 6 of value); 0 marks an empty slot
        start = 4 * pre_ints
        _need(len(blob) >= start, "HLL", f"its {len(blob)} bytes are shorter than its {start}-byte header")
        count = byte6 if cur == LIST else struct.unpack_from("<I", blob, 8)[0]
        stored = count if compact else 1 << lg_arr
        if flags & HLL_EMPTY:
            _need(count == 0 and len(blob) in (start, start + 4 * stored), "HLL", "an empty sketch holding bytes")
            return np.zeros(m, np.uint8)
        _need(len(blob) == start + 4 * stored, "HLL",
              f"{len(blob)} bytes, not the {start + 4 * stored} of a header and {stored} coupons")
        found = np.frombuffer(blob, "<u4", stored, start)
        found = found[found != 0]
        _need(len(found) == count and np.all(found >> 26 > 0), "HLL", f"not {count} valid coupons")
        registers = np.zeros(m, np.uint8)
        np.maximum.at(registers, (found & (m - 1)).astype(np.int64), (found >> 26).astype(np.uint8))
        return registers
    _need(not flags & HLL_EMPTY, "HLL", "an empty sketch in HLL mode")
    _need(len(blob) >= 40, "HLL", f"its {len(blob)} bytes are shorter than its 40-byte header")
    cur_min, aux_count = byte6, struct.unpack_from("<I", blob, 36)[0]
    start = 40
    if kind != HLL_4:
        size = m if kind == HLL_8 else 3 * m // 4 + 1
        _need(len(blob) == start + size, "HLL", f"{len(blob)} bytes, not the {start + size} of {m} registers")
        if kind == HLL_8:
            registers = np.frombuffer(blob, np.uint8, m, start).copy()
            _need(registers.max() <= 63, "HLL", f"a register of {registers.max()}, past 63")
            return registers
        bits = np.unpackbits(np.frombuffer(blob, np.uint8, size, start), bitorder="little")
        return (bits[: 6 * m].reshape(m, 6) << np.arange(6)).sum(axis=1).astype(np.uint8)
    # the exceptions' slots: compact, as many as it holds; updatable, a hash table (any size; 0 marks a free slot)
    stored = aux_count if compact else max(len(blob) - start - m // 2, 0) // 4
    _need(len(blob) == start + m // 2 + 4 * stored, "HLL",
          f"{len(blob)} bytes, not the {start + m // 2 + 4 * stored} of {m} registers and {stored} exceptions")
    _need(cur_min + 14 <= 63, "HLL", f"a smallest register of {cur_min}")
    nibbles = np.frombuffer(blob, np.uint8, m // 2, start)
    values = np.stack([nibbles & 0xF, nibbles >> 4], axis=1).reshape(-1)
    registers = np.where(values == AUX_TOKEN, 0, values + cur_min).astype(np.uint8)
    found = np.frombuffer(blob, "<u4", stored, start + m // 2)  # exceptions: (slot, value) coupons after the array
    found = found[found != 0]
    slots, high = (found & (m - 1)).astype(np.int64), (found >> 26).astype(np.uint8)
    _need(len(found) == aux_count and np.array_equal(np.sort(slots), np.flatnonzero(values == AUX_TOKEN))
          and np.all(high >= cur_min + AUX_TOKEN), "HLL", f"exceptions that are not those of its {AUX_TOKEN} registers")
    registers[slots] = high
    return registers


def fold_registers(registers: np.ndarray, lg_k: int) -> np.ndarray:
    """Registers of ``2^lg_k`` slots from more (a larger sketch's): each slot the maximum of those it folds."""
    return registers.reshape(-1, 1 << lg_k).max(axis=0)


def hll_sketches(state: np.ndarray | None) -> list[bytes]:
    """Per column, the HLL_8 bytes of a distinct count's register records."""
    if state is None:
        raise UsageError("this DistinctCountResult's registers do not hash values as DataSketches does; run "
                         "DistinctCount(datasketches=True) to get one that to_datasketches() can write.")
    return [hll_bytes(column["registers"]) for column in np.atleast_1d(state)]
