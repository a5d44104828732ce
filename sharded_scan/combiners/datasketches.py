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
:func:`~sharded_scan.from_datasketches` merges into a run. Layouts: datasketches-cpp
``kll_sketch_impl.hpp`` (serial versions 1 and 2), ``frequent_items_sketch_impl.hpp`` and ``hll/``
(``HllArray``, ``CouponList``, ``Hll4Array``).
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import numpy as np

from sharded_scan.combiners import kll, wide
from sharded_scan.combiners.keys import KIND_DTYPES, decode, is_float, nan_key
from sharded_scan.errors import UsageError

KLL_FAMILY, KLL_M, KLL_MAX_K = 15, 8, (1 << 16) - 1
KLL_EMPTY, KLL_LEVEL_ZERO_SORTED, KLL_SINGLE_ITEM = 1, 2, 4  # flag bits
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


def read_kll(blob: bytes) -> KllImage:
    """The levels, ``n``, min and max of a KLL sketch's bytes (``kll_floats_sketch``/``kll_doubles_sketch``)."""
    blob = bytes(blob)
    if len(blob) < 8 or blob[2] != KLL_FAMILY:
        raise UsageError("these bytes are not a DataSketches KLL sketch (family 15); pass what a "
                         "kll_floats_sketch or kll_doubles_sketch's serialize() returned.")
    _, version, _, flags, k, _, _ = struct.unpack_from("<BBBBHBB", blob)
    if flags & KLL_EMPTY:
        return KllImage(k, k, 0, [], math.nan, math.nan, 8)
    if flags & KLL_SINGLE_ITEM:
        itemsize = len(blob) - 8
        item = np.frombuffer(blob, "<f" if itemsize == 4 else "<d", 1, 8).astype(np.float64)
        return KllImage(k, k, 1, [item], float(item[0]), float(item[0]), itemsize)
    n, min_k, num_levels, _ = struct.unpack_from("<QHBB", blob, 8)
    offsets = np.frombuffer(blob, "<u4", num_levels, 20).astype(np.int64)
    capacity = kll_capacity(k, num_levels)
    start = 20 + 4 * num_levels
    retained = capacity - int(offsets[0])
    itemsize = (len(blob) - start) // (retained + 2)
    if itemsize not in (4, 8) or start + itemsize * (retained + 2) != len(blob):
        raise UsageError("these bytes are not a KLL sketch of floats or doubles (their length does not match "
                         "their levels); pass what a kll_floats_sketch or kll_doubles_sketch's serialize() returned.")
    values = np.frombuffer(blob, "<f" if itemsize == 4 else "<d", retained + 2, start).astype(np.float64)
    bounds = np.append(offsets, capacity) - offsets[0]
    levels = [np.sort(values[2 + bounds[h]: 2 + bounds[h + 1]]) for h in range(num_levels)]
    return KllImage(k, min_k, n, levels, float(values[0]), float(values[1]), itemsize)


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
            levels.append(decode(keys, code).astype(np.float64))
        kept = np.concatenate(levels)
        low, high = decode(column["low"], code), column["high"]  # (an empty column's are not written)
        high = kept.max(initial=-math.inf) if floats and high == nan_key(high.dtype) else decode(high, code)
        out.append(kll_bytes(levels, k, float(low), float(high), itemsize))
    return out


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
        payload = np.asarray(items).astype("<q" if item == "long" else "<d").tobytes()  # uint64: its bits
    return b"".join([
        struct.pack("<BBBBBBH", 4, 1, FI_FAMILY, lg, lg, 0, 0),
        struct.pack("<IIQQ", len(items), 0, total_weight, offset),
        np.asarray(weights, "<u8").tobytes(), payload,
    ])


def read_frequent_items(blob: bytes, item: str) -> FrequentImage:
    """The items, weights and offset of a Frequent Items sketch's bytes, its items written as ``item``
    (``"long"``, ``"double"`` or ``"string"``, as :func:`frequent_items_bytes`)."""
    blob = bytes(blob)
    if len(blob) < 8 or blob[2] != FI_FAMILY:
        raise UsageError("these bytes are not a DataSketches Frequent Items sketch (family 10); pass what a "
                         "frequent_items_sketch or frequent_strings_sketch's serialize() returned.")
    lg_max = blob[3]
    if blob[5] & FI_EMPTY:
        return FrequentImage([], np.zeros(0, np.int64), 0, 0, lg_max)
    n, _, total, offset = struct.unpack_from("<IIQQ", blob, 8)
    weights = np.frombuffer(blob, "<u8", n, 32).astype(np.int64)
    start = 32 + 8 * n
    if item == "string":
        items = []
        for _ in range(n):
            (size,) = struct.unpack_from("<I", blob, start)
            items.append(blob[start + 4: start + 4 + size].decode())
            start += 4 + size
    else:
        if len(blob) != start + 8 * n:
            raise UsageError(f"these Frequent Items bytes do not hold {n} 8-byte items; a numeric column takes a "
                             "frequent_items_sketch of PyLongsSerDe (integers) or PyDoublesSerDe (floats).")
        items = np.frombuffer(blob, "<q" if item == "long" else "<d", n, start).tolist()
    return FrequentImage(items, weights, int(offset), int(total), lg_max)


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
        out.append(frequent_items_bytes(decode(column["keys"][:held], column["kind"]), weights, offset,
                                        int(weights.sum()), capacity, item_kind(column["kind"])))
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


def read_hll(blob: bytes) -> np.ndarray:
    """The ``2^lg_k`` registers (uint8) of an HLL sketch's bytes, in any of its modes and types."""
    blob = bytes(blob)
    if len(blob) < 8 or blob[2] != HLL_FAMILY:
        raise UsageError("these bytes are not a DataSketches HLL sketch (family 7); pass what an hll_sketch's "
                         "serialize_compact() or serialize_updatable() returned.")
    pre_ints, lg_k, lg_arr, flags, byte6, mode = blob[0], blob[3], blob[4], blob[5], blob[6], blob[7]
    m = 1 << lg_k
    registers = np.zeros(m, np.uint8)
    if flags & HLL_EMPTY:
        return registers
    if mode & 3 != HLL:  # LIST or SET: coupons (26 bits of slot, 6 of value); 0 marks an empty slot
        count = byte6 if mode & 3 == LIST else struct.unpack_from("<I", blob, 8)[0]
        start = 4 * pre_ints
        stored = count if flags & HLL_COMPACT else 1 << lg_arr
        found = np.frombuffer(blob, "<u4", stored, start)
        found = found[found != 0]
        np.maximum.at(registers, (found & (m - 1)).astype(np.int64), (found >> 26).astype(np.uint8))
        return registers
    cur_min = byte6
    aux_count = struct.unpack_from("<I", blob, 36)[0]
    kind = (mode >> 2) & 3
    start = 40
    if kind == HLL_8:
        return np.frombuffer(blob, np.uint8, m, start).copy()
    if kind == HLL_6:
        packed = np.frombuffer(blob, np.uint8, (6 * m + 7) // 8, start)
        bits = np.unpackbits(packed, bitorder="little")
        return (bits[: 6 * m].reshape(m, 6) << np.arange(6)).sum(axis=1).astype(np.uint8)
    nibbles = np.frombuffer(blob, np.uint8, m // 2, start)
    values = np.stack([nibbles & 0xF, nibbles >> 4], axis=1).reshape(-1)
    registers = np.where(values == AUX_TOKEN, 0, values + cur_min).astype(np.uint8)
    if aux_count:  # exceptions: (slot, value) coupons after the array
        stored = aux_count if flags & HLL_COMPACT else 1 << lg_arr
        found = np.frombuffer(blob, "<u4", stored, start + m // 2)
        found = found[found != 0]
        registers[(found & (m - 1)).astype(np.int64)] = (found >> 26).astype(np.uint8)
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
