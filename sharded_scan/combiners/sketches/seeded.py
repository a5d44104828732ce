"""Runs that start from other systems' sketches: ``from_datasketches(combiner, sketches, item)``.

A :class:`FromDataSketches` runs ``combiner`` unchanged (the same accumulator, steps and
checkpoints) and, in ``finalize``, merges into the merged accumulator the DataSketches
sketches given, one per column: KLL bytes into a :class:`~sharded_scan.Quantiles` sketch,
Frequent Items bytes into a :class:`~sharded_scan.TopK` summary, HLL bytes (any mode and
type, ``lg_k`` at least ``precision``: folded down) into a :class:`~sharded_scan.DistinctCount`'s
registers by maximum, its columns then estimates (formats:
:mod:`~sharded_scan.combiners.sketches.datasketches`). So a sketch Spark or Druid built over other
rows is merged in once, whatever the device count; the seeds' digests name the job.

A KLL sketch's levels go into ours as runs of at most our capacities (its level ``h`` weighs
``2^h`` in both), its ``n``, min and max exactly; its rounding error, DataSketches' stated
rank error for its ``min_k``, joins the result's ``rank_error``. A column's seed may have
another ``n`` than the rows this run read, so a seeded ``QuantilesResult`` has one
``count`` per column. A Frequent Items sketch's items come in with their weights as
counts and its offset as their slack and as the bound on unlisted values, as if TopK had
counted them (an item listed twice: once, both weights).

KLL and Frequent Items bytes hold no item type, so the caller names it (``item``) and the
readers check it against what the bytes do tell (their lengths; Java's KLL flags); each value
is then kept only if the column's type holds it exactly. Every seed is read and checked in
``check_spec``, before any compute: malformed, truncated or crafted bytes, a weight past
``2^63 - 1`` and a seed's rows past ``2^62`` (:data:`COUNT_MAX`) are one line naming the column.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any

import jax
import numpy as np

from sharded_scan.combiners import wide
from sharded_scan.combiners.sketches import kll
from sharded_scan.combiners.sketches.datasketches import (
    FREQUENT_ITEMS,
    KLL_ITEMS,
    fold_registers,
    kll_rank_error,
    read_frequent_items,
    read_hll,
    read_kll,
)
from sharded_scan.combiners.sketches.distinct import DistinctCount
from sharded_scan.combiners.sketches.keys import GOLDEN, KIND_DTYPES, bits, fill, keyed_as, np_float_keys
from sharded_scan.combiners.sketches.quantiles import CONFIDENCE, Quantiles
from sharded_scan.combiners.sketches.quantiles_result import QuantilesAcc
from sharded_scan.combiners.sketches.topk import LIMBS, TopK, TopKAcc
from sharded_scan.combiners.wrappers.policies import Wrapper
from sharded_scan.errors import UsageError

COUNT_MAX = 1 << 62  # a seed's rows: the counts (63-bit Wide) keep them exactly with any run's rows


def from_datasketches(combiner: Any, sketches: Any, item: str | list | tuple | None = None) -> FromDataSketches:
    """``combiner`` seeded with Apache DataSketches sketches, merged into its result.

    Args:
      combiner: a :class:`~sharded_scan.Quantiles` (``exact=False``), :class:`~sharded_scan.TopK` or
        :class:`~sharded_scan.DistinctCount`.
      sketches: one serialized sketch per column of the data (a bytes for rows of one value):
        KLL sketches (``serialize()``) for ``Quantiles``; Frequent Items sketches for ``TopK``;
        HLL sketches (``hll_sketch``'s ``serialize_compact()`` or ``serialize_updatable()``) for
        ``DistinctCount``. None for a column skips it.
      item: the sketches' item type, which KLL and Frequent Items bytes do not hold (their lengths
        tell 4-byte items from 8-byte ones at most), so ``Quantiles`` and ``TopK`` need it: ``"float"``
        (``kll_floats_sketch``, ``PyFloatsSerDe``), ``"double"`` (``kll_doubles_sketch``,
        ``PyDoublesSerDe``), ``"int"`` (``kll_ints_sketch``, ``PyIntsSerDe``) or ``"long"`` (Java's
        ``KllLongsSketch``, ``PyLongsSerDe``); one for every column, or a list of one per column.
        None for ``DistinctCount`` (HLL registers hold no items).

    Returns:
      a combiner to pass to :func:`sharded_scan.run`: its result is ``combiner``'s over the rows
      and the sketches together. Bytes that do not match ``item`` and every malformed, truncated
      or crafted sketch are one :class:`~sharded_scan.UsageError` line before any compute.
    """
    if not isinstance(combiner, Quantiles | TopK | DistinctCount) or (isinstance(combiner, Quantiles)
                                                                      and combiner.exact):
        raise UsageError(f"from_datasketches seeds Quantiles(exact=False) with KLL sketches, TopK with Frequent "
                         f"Items sketches and DistinctCount with HLL sketches, got {combiner!r}.")
    if isinstance(combiner, DistinctCount) and not combiner.datasketches:
        raise UsageError("from_datasketches merges HLL sketches into DistinctCount(datasketches=True) only (registers "
                         "that hash values as DataSketches does); pass datasketches=True.")
    blobs = [sketches] if isinstance(sketches, bytes | bytearray | memoryview) else list(sketches)
    if not all(b is None or isinstance(b, bytes | bytearray | memoryview) for b in blobs):
        raise UsageError("from_datasketches takes one serialized sketch (bytes) per column, or None for a column "
                         f"without one; got {type(sketches).__name__}.")
    return FromDataSketches(combiner, tuple(None if b is None else bytes(b) for b in blobs),
                            _items(combiner, item, len(blobs)))


def _items(combiner, item, d: int) -> tuple:
    """Per column, the item type of ``combiner``'s seeds (one line when missing or not one it takes)."""
    if isinstance(combiner, DistinctCount):
        if item is not None:
            raise UsageError("from_datasketches reads HLL sketches' registers, which hold no item type; leave item= "
                             "out for DistinctCount.")
        return ()
    allowed = tuple(i for i in (KLL_ITEMS if isinstance(combiner, Quantiles) else FREQUENT_ITEMS) if i != "string")
    sketch = "KLL" if isinstance(combiner, Quantiles) else "Frequent Items"
    if item is None:
        example = ("'float' for a kll_floats_sketch, 'int' for a kll_ints_sketch" if sketch == "KLL" else
                   "'long' for PyLongsSerDe's items, 'double' for PyDoublesSerDe's")
        raise UsageError(f"from_datasketches needs the {sketch} sketches' item type, which their bytes do not hold: "
                         f"pass item= one of {allowed} (e.g. {example}).")
    items = (item,) * d if isinstance(item, str) else tuple(item)
    if len(items) != d or not all(i in allowed for i in items):
        raise UsageError(f"from_datasketches takes item= one of {allowed}, or a list of one per sketch ({d}); got "
                         f"{item!r}.")
    return items


@dataclasses.dataclass(frozen=True, eq=False)
class FromDataSketches(Wrapper):
    """``inner`` with DataSketches ``sketches`` (bytes per column) merged in at ``finalize``.

    It equals (and hashes as) ``inner``: its compiled programs are ``inner``'s (the engine's memo
    shares them), as the seeds are read on the host only; the fingerprint names the seeds.
    """

    sketches: tuple = ()
    items: tuple = ()  # per column, the seeds' item type (datasketches.ITEMS); () for HLL

    def __eq__(self, other):
        return self.inner == (other.inner if isinstance(other, FromDataSketches) else other)

    def __hash__(self):
        return hash(self.inner)

    def fingerprint(self):
        digests = [None if b is None else hashlib.sha256(b).hexdigest() for b in self.sketches]
        return {**self.inner.fingerprint(), "datasketches": repr(digests),
                **({"datasketches_items": repr(list(self.items))} if self.items else {})}

    def check_spec(self, spec):
        self.inner.check_spec(spec)
        d = spec.shape[0] if spec.shape else 1
        if len(self.sketches) != d:
            raise UsageError(f"from_datasketches got {len(self.sketches)} sketches for data of {d} columns; pass one "
                             "per column (None for a column without one).")
        code = KIND_DTYPES.index(keyed_as(spec.dtype))
        for j, blob in enumerate(self.sketches):  # every seed read and its values checked before any compute
            if blob is not None:
                try:
                    self._check_seed(j, blob, code)
                except UsageError as e:
                    raise UsageError(f"from_datasketches: the sketch of column {j}: {e}") from None

    def _check_seed(self, j: int, blob: bytes, code: int) -> None:
        if isinstance(self.inner, Quantiles):
            image = read_kll(blob, self.items[j])
            if image.n > COUNT_MAX:
                raise UsageError(f"a KLL sketch of n={image.n} rows, past 2^62, the most a seeded count holds exactly.")
            _keys(np.concatenate([*image.levels, [image.min, image.max]]) if image.n else np.zeros(0), code)
        elif isinstance(self.inner, DistinctCount):
            self._registers(blob)
        else:
            image = read_frequent_items(blob, self.items[j])
            if sum(image.weights.tolist()) + image.offset > COUNT_MAX:
                raise UsageError(f"a Frequent Items sketch whose weights and offset ({image.offset}) sum past 2^62, "
                                 "the most TopK's counts hold exactly with the run's rows.")
            _keys(np.asarray(image.items), code)

    def omitting_values(self):
        raise UsageError("from_datasketches(...) cannot skip a NaN or Inf where it stands (nan_policy='omit') yet: "
                         "pass nan_policy='omit_rows' (each row holding one skipped) or leave such values out of "
                         "the data.")

    def partition(self, mesh):
        return self.inner.partition(mesh)

    def convert(self, acc, source):
        return self.inner.convert(acc, source.inner)

    def init(self, spec):
        return self.inner.init(spec)

    def add(self, acc, batch, mask):
        return self.inner.add(acc, batch, mask)

    def merge(self, a, b):
        return self.inner.merge(a, b)

    def finalize(self, acc):
        if getattr(self.inner, "model_shards", 1) > 1:  # split over model: the seeds merge into the whole state
            whole = self.inner.whole
            return dataclasses.replace(self, inner=whole).finalize(whole.convert(acc, self.inner))
        if isinstance(self.inner, TopK):
            return self.inner.finalize(_host(_merger(self.inner)(acc, self._topk_seed(acc))))
        if isinstance(self.inner, DistinctCount):
            return self.inner.finalize(self._distinct(acc))
        return self._quantiles(acc)

    def _registers(self, blob: bytes) -> np.ndarray:
        """A seed's registers at our precision; a smaller sketch is one line."""
        registers = read_hll(blob)
        lg_k = registers.shape[0].bit_length() - 1
        if lg_k < self.inner.precision:
            raise UsageError(f"an HLL sketch of lg_k={lg_k} cannot be merged into DistinctCount(precision="
                             f"{self.inner.precision}); run DistinctCount(precision={lg_k}) (or less).")
        return fold_registers(registers, self.inner.precision)

    def _distinct(self, acc):
        registers, held = np.array(acc.registers), np.array(acc.held).reshape(-1)
        for j, blob in enumerate(self.sketches):
            if blob is not None:
                seed = self._registers(blob)
                registers[j] = np.maximum(registers[j], seed)
                held[j] = held[j] if not seed.any() else self.inner.exact_up_to + 1  # an estimate now
        return acc._replace(registers=registers, held=held.reshape(np.shape(acc.held)))

    def _quantiles(self, acc: QuantilesAcc):
        code, k = int(acc.kind), self.inner.k
        low, high = np.asarray(acc.low).reshape(-1), np.asarray(acc.high).reshape(-1)
        results = []
        for j, blob in enumerate(self.sketches):
            sketch = acc.sketch._replace(items=np.asarray(acc.sketch.items)[j:j + 1])
            column = acc._replace(sketch=sketch, low=low[j:j + 1], high=high[j:j + 1])
            for seed in ([] if blob is None else _kll_seeds(read_kll(blob, self.items[j]), k, code)):
                column = _host(_merger(self.inner)(column, seed))
            results.append(self.inner.finalize(column))
        one = np.ndim(acc.low) == 0
        quantiles = np.stack([np.atleast_2d(r.quantiles)[0] for r in results])
        counts = np.array([int(r.count) for r in results], np.int64)
        state = np.concatenate([r.sketch for r in results])
        return results[0]._replace(
            quantiles=quantiles[0] if one else quantiles, count=counts[0] if one else counts,
            rank_error=np.float64(max(float(r.rank_error) for r in results)), sketch=state[0] if one else state)

    def _topk_seed(self, acc: TopKAcc) -> TopKAcc:
        code, c = int(acc.kind), self.inner.capacity
        d = np.asarray(acc.keys).shape[0]
        keys = np.full((d, c), fill(np.asarray(acc.keys).dtype))
        count, slack = np.zeros((d, c), np.int64), np.zeros((d, c), np.int64)
        held, bound = np.zeros(d, np.int32), np.zeros(d, np.int64)
        for j, blob in enumerate(self.sketches):
            if blob is None:
                continue
            image = read_frequent_items(blob, self.items[j])
            found, where = np.unique(_keys(np.asarray(image.items), code), return_inverse=True)
            weights = np.zeros(len(found), np.int64)
            np.add.at(weights, where.reshape(-1), image.weights)  # an item listed twice counts once, both weights
            order = np.argsort(-weights, kind="stable")
            kept, dropped = order[:c], order[c:]
            n = len(kept)
            keys[j, :n] = found[kept]
            count[j, :n], slack[j, :n] = weights[kept], image.offset
            held[j] = n
            bound[j] = max(image.offset, int(weights[dropped].max(initial=0)) + image.offset)
        return TopKAcc(keys, _wide(count), _wide(slack), held.reshape(np.shape(acc.held)), _wide(bound),
                       np.asarray(acc.kind))


@functools.cache
def _merger(combiner):
    """The combiner's merge, compiled once per combiner (equal combiners share it)."""
    return jax.jit(combiner.merge)


def _host(acc):
    return jax.tree.map(np.asarray, acc)


def _wide(values: np.ndarray) -> wide.Wide:
    """Non-negative int64 values as a host :class:`~.wide.Wide` of ``LIMBS`` limbs."""
    v = np.asarray(values, np.int64)
    limbs = [(v >> (wide.LIMB_BITS * i)) & 0xFFFF for i in range(LIMBS - 1)] + [v >> (wide.LIMB_BITS * (LIMBS - 1))]
    return wide.Wide(np.stack(limbs, axis=-1).astype(np.int32))


def _keys(values: np.ndarray, code: int) -> np.ndarray:
    """The keys of a seed's values in a column of key kind ``code``; a value the column's type does not
    hold exactly is one line."""
    t = KIND_DTYPES[code]
    b = bits(t)
    values = np.asarray(values)
    if t.kind == "f":
        cast = values.astype(t)
        if values.dtype.kind in "iu":  # integers: exact when the float is that integer
            whole = np.isfinite(cast) & (np.abs(cast) < 2.0**63)
            exact = whole & (np.where(whole, cast, 0).astype(np.int64) == values)
        else:
            exact = (cast.astype(np.float64) == values) | np.isnan(values)
        keys = np_float_keys(cast, t)
    else:
        info = np.iinfo(t)
        if values.dtype.kind in "iu":  # integers (the readers' int64): compared as integers, within both types
            have = np.iinfo(values.dtype)
            exact = (values >= max(info.min, have.min)) & (values <= min(info.max, have.max))
            whole = values
        else:  # floats: whole numbers in range (float(info.max) + 1: the first float past it)
            whole = np.where(np.isfinite(values), values, 0.5)
            exact = (np.floor(whole) == whole) & (whole >= float(info.min)) & (whole < float(info.max) + 1.0)
        cast = np.where(exact, whole, 0).astype(t)
        keys = cast.astype(b.key) if t.kind == "u" else cast.view(b.key) ^ b.key(b.sign)
    if not np.all(exact):
        bad = values.reshape(-1)[~exact.reshape(-1)][0]
        raise UsageError(f"a DataSketches sketch holds the value {bad!r}, which this {t} column cannot hold exactly; "
                         "seed a column of a type that holds the sketch's values.")
    return keys.astype(b.key)


def _kll_seeds(image, k: int, code: int) -> list[QuantilesAcc]:
    """A KLL sketch's items as one-column accumulators of ``Quantiles(k=k)`` to merge in one after another:
    each level cut into runs of fewer than our capacity at its depth; the first carries ``n``, min,
    max and the sketch's stated rank error as a rounding variance."""
    if image.n == 0:
        return []
    key_type = bits(KIND_DTYPES[code]).key
    levels = [_keys(items, code) for items in image.levels]
    top, caps = len(levels) - 1, kll.capacities(k)
    take = [max(int(caps[min(top - h, kll.LEVELS - 1)]) - 1, 1) for h in range(len(levels))]
    z = math.log(2.0 / (1.0 - CONFIDENCE))
    variance = (kll_rank_error(image.min_k) * image.n) ** 2 / (2.0 * z) if image.n > 1 and top > 0 else 0.0
    seeds, done = [], [0] * len(levels)
    while any(done[h] < len(levels[h]) for h in range(len(levels))):
        items = np.full((1, kll.flat_size(k)), fill(key_type))
        sizes = np.zeros(kll.LEVELS, np.int32)
        at = 0
        for h, level in enumerate(levels):
            part = level[done[h]: done[h] + take[h]]
            items[0, at: at + len(part)], sizes[h] = part, len(part)
            at, done[h] = at + len(part), done[h] + len(part)
        first = not seeds
        sketch = kll.Sketch(items, sizes, np.float32(variance if first else 0.0), np.uint32(GOLDEN), np.bool_(False))
        ends = _keys(np.array([image.min, image.max]), code) if first else np.array([fill(key_type), 0], key_type)
        seeds.append(QuantilesAcc(sketch, _wide(np.int64(image.n if first else 0)), ends[:1], ends[1:],
                                  np.int32(code)))
    return seeds
