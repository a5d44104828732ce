"""Distinct counts per column: HyperLogLog registers merged by maximum, exact below a set size.

Every value's 32-bit key (:mod:`~sharded_scan.combiners.sketches.keys`) is hashed twice by a
bijective mixer: the top ``precision`` bits of the first hash pick one of
``m = 2^precision`` registers, and the leading zeros of the second (plus one, 1..33)
are what the register keeps the maximum of. A 64-bit value's 64-bit key is hashed once
by a bijective 64-bit mixer, whose top bits pick the register and whose low 32 bits
give the leading zeros. Distinct keys give distinct hashes, so no two distinct values
collide in the bits used. ``DistinctCount(datasketches=True)`` hashes every value as Apache
DataSketches' ``hll_sketch`` does instead (:mod:`~.murmur`: MurmurHash3_x64_128, seed 9001, of
its int64 or float64 bytes; the register from the low bits of the first half, 1 + the leading
zeros of the second, at most 63), so its registers are an HLL_8 sketch DataSketches reads and
merges (``DistinctCountResult.to_datasketches``). Partials merge by elementwise
maximum, so the merge and therefore the result do not depend on how rows are split.
``finalize`` applies Ertl's improved estimator ("New cardinality estimation algorithms
for HyperLogLog sketches", 2017), which needs no bias tables and holds its standard
error of about ``1.04 / sqrt(m)`` (0.81% at the default ``m = 16384``) from a handful of
values to billions (measured in ``bench/sketches.py``).

Each column's distinct keys are also kept while there are at most ``E = exact_up_to`` of
them (sorted, ``E`` slots per column; by default ``2^precision``, the registers' count):
such columns get their exact count, like ``pandas.Series.nunique``. Once every column has
more, a micro-batch only updates the registers. ``GroupBy(DistinctCount(...), K)`` keeps registers
(and values) per key: the registers in one scatter-max (:meth:`DistinctCount.add_keyed`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners.base import Combiner
from sharded_scan.combiners.column_split import SplitsEachColumn
from sharded_scan.combiners.results import frame
from sharded_scan.combiners.sketches import murmur
from sharded_scan.combiners.sketches.datasketches import hll_sketches, hll_state
from sharded_scan.combiners.sketches.keys import (
    GOLDEN,
    KIND_DTYPES,
    check_column_spec,
    columns,
    fill,
    finite_cells,
    fold_groups,
    fold_if_any,
    key_dtype,
    keyed_as,
    mix32,
    mix64,
    per_column,
    real_values,
    run_window,
    running_sum,
    sort_by_key,
)
from sharded_scan.errors import UsageError

DEFAULT_PRECISION = 14
RANK_BITS = 32  # a register holds 1 + the leading zeros of a 32-bit hash: 1..33 (0: untouched)


class DistinctCountResult(NamedTuple):
    """Per column: the number of distinct values, whether it is exact, and its standard error.

    ``count`` is int64 ``(d,)`` (``()`` for rows of one value); ``exact`` marks columns
    counted exactly (at most ``exact_up_to`` values); ``relative_error`` is the estimate's standard
    error ``1.04 / sqrt(m)`` (0 where exact).
    """

    count: np.ndarray
    exact: np.ndarray
    relative_error: np.ndarray
    sketch: np.ndarray | None = None  # with datasketches=True: the registers, a record per column
    columns: np.ndarray | None = None  # X's column names (a DataFrame, Parquet, CSV), else np.arange(d)

    def to_datasketches(self) -> list[bytes] | bytes:
        """Per column, the bytes of an Apache DataSketches HLL sketch (HLL_8, ``lg_k = precision``) of the
        registers of a ``DistinctCount(datasketches=True)``: ``datasketches.hll_sketch.deserialize`` reads it
        and ``hll_union`` merges it with sketches of the same values (integers hashed as int64, floats as
        float64; a string column's hash ids, not its strings). A list of ``d`` bytes (one bytes for rows of
        one value)."""
        blobs = hll_sketches(self.sketch)
        return blobs[0] if np.ndim(self.count) == 0 else blobs

    def to_pandas(self):
        """A DataFrame: a row per column, ``count`` (``df.nunique(dropna=False)``), ``exact``, ``relative_error``."""
        return frame(self, ("count", "exact", "relative_error"))


class DistinctAcc(NamedTuple):
    """HLL registers and, while there are few, the distinct keys themselves."""

    registers: jax.Array  # uint8 (d, m)
    keys: jax.Array       # uint32 or uint64 (d, max(E, 1)): sorted distinct keys, the filler past the last
    held: jax.Array       # int32 (d,): distinct keys held; E + 1 once there were more than E


def register_updates(keys: jax.Array, mask: jax.Array, precision: int,
                     code: int | None = None, string_ids: bool = False) -> tuple[jax.Array, jax.Array]:
    """Each key's register index and value (0 where ``mask``, ``(mb,)`` or a mask per column ``(d, mb)``, is
    False): ``(d, mb)`` each; with ``code`` (the keys' :data:`~.keys.KIND_DTYPES` index) DataSketches' coupons
    (:func:`~.murmur.coupons`; of strings' ids, ``string_ids``: :func:`~.murmur.string_coupons`)."""
    if code is not None:
        index, rank = (murmur.string_coupons if string_ids else murmur.coupons)(keys, code, precision)
    elif keys.dtype == jnp.uint64:
        first = mix64(keys)
        second = first.astype(jnp.uint32)  # the low half: bits the index (the top ones) does not use
        index = (first >> (64 - precision)).astype(jnp.int32)
    else:
        first = mix32(keys)
        second = mix32(first ^ jnp.uint32(GOLDEN))
        index = (first >> (32 - precision)).astype(jnp.int32)
    if code is None:
        rank = jax.lax.clz(second).astype(jnp.uint8) + jnp.uint8(1)
    return index, jnp.where(per_column(mask), rank, jnp.uint8(0))


def unique_prefix(keys: jax.Array, valid: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """The sorted distinct values among each row's first ``valid`` keys, and how many.

    ``keys`` ``(d, n)``: valid entries anywhere, the others the filler. Returns the first
    ``capacity`` distinct keys per row (the filler after them) and the distinct count.
    """
    s = jnp.sort(keys, axis=1)
    pos = jnp.arange(s.shape[1], dtype=jnp.int32)
    fresh = (pos < valid[:, None]) & jnp.concatenate([jnp.ones_like(s[:, :1], bool), s[:, 1:] != s[:, :-1]], axis=1)
    slot = jnp.where(fresh, running_sum(fresh.astype(jnp.int32)) - 1, capacity)
    rows = jnp.arange(s.shape[0])[:, None]
    kept = jnp.full((s.shape[0], capacity + 1), fill(s.dtype), s.dtype).at[rows, jnp.minimum(slot, capacity)].set(s)
    return kept[:, :capacity], jnp.sum(fresh, axis=1, dtype=jnp.int32)


def run_once(pred: jax.Array, f, *operands):
    """``f(*operands)`` where ``pred``, else ``operands`` (a tuple); a ``while_loop`` of at most one turn,
    whose carry XLA updates in place: a ``cond`` copies the operands it returns unchanged (a state's
    ``E`` slots each micro-batch, about 15% of the estimate's step)."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.zeros_like(c[0]), f(*c[1])), (pred, operands))[1]


# more_than's table holds at most this many slots over all columns (bools: 16 MiB); past it, no bound.
BOUND_SLOTS = 1 << 24


def bound_bits(e: int, d: int) -> int:
    """The bits of :func:`more_than`'s slots for ``E = e`` over ``d`` columns: about ``8 E`` slots a
    column, at least ``2 E`` (else it rarely shows more than ``E``); 0 where they would not fit in
    :data:`BOUND_SLOTS` (no bound)."""
    bits = e.bit_length() + 2
    fits = (BOUND_SLOTS // max(d, 1)).bit_length() - 1
    return min(bits, fits) if min(bits, fits) > e.bit_length() else 0


def more_than(keys: jax.Array, held: jax.Array, batch_keys: jax.Array, rows: jax.Array, e: int) -> jax.Array:
    """Per column, True where its first ``held`` of ``keys`` ``(d, E)`` and the ``rows`` (``(mb,)``, or each
    column's own ``(d, mb)``) of ``batch_keys`` ``(d, mb)`` hold more than ``e`` distinct values for sure: more
    than ``e`` of the slots their hashes' top bits pick (:func:`bound_bits`) are taken, and distinct slots are
    distinct values. A cheap lower bound (a scatter, no sort): False says nothing."""
    d, bits = keys.shape[0], bound_bits(e, keys.shape[0])
    both = jnp.concatenate([keys, batch_keys], axis=1)
    real = jnp.concatenate([jnp.arange(keys.shape[1]) < held[:, None],
                            jnp.broadcast_to(per_column(rows), batch_keys.shape)], axis=1)
    mixed = mix64(both) if both.dtype == jnp.uint64 else mix32(both)
    slot = jnp.where(real, (mixed >> (8 * both.dtype.itemsize - bits)).astype(jnp.int32), 1 << bits)
    taken = jnp.zeros((d, 1 << bits), bool).at[jnp.arange(d)[:, None], slot].set(True, mode="drop")
    return jnp.sum(taken, axis=1, dtype=jnp.int32) > e


def sigma(x: float) -> float:
    """Ertl's sigma: the contribution of untouched registers (fraction ``x``)."""
    if x == 1.0:
        return math.inf
    y, z = 1.0, x
    while True:
        x *= x
        before, z = z, z + x * y
        y += y
        if z == before:
            return z


def tau(x: float) -> float:
    """Ertl's tau: the contribution of saturated registers (``x`` = 1 - their fraction)."""
    if x in (0.0, 1.0):
        return 0.0
    y, z = 1.0, 1.0 - x
    while True:
        x = math.sqrt(x)
        y *= 0.5
        before, z = z, z - (1.0 - x) ** 2 * y
        if z == before:
            return z / 3.0


def estimate(registers: np.ndarray, rank_bits: int = RANK_BITS) -> float:
    """Ertl's improved raw estimator of the distinct count from one column's registers (values up to
    ``rank_bits + 1``)."""
    m = registers.shape[0]
    hist = np.bincount(registers.astype(np.int64), minlength=rank_bits + 2).astype(np.float64)
    z = m * tau(1.0 - hist[rank_bits + 1] / m)
    for k in range(rank_bits, 0, -1):
        z = 0.5 * (z + hist[k])
    z += m * sigma(hist[0] / m)
    return m * m / (2.0 * math.log(2.0)) / z


@dataclasses.dataclass(frozen=True)
class DistinctCount(SplitsEachColumn, Combiner):
    """The number of distinct values in each column, like ``len(np.unique(x[:, j]))``.

    Args:
      precision: ``m = 2^precision`` one-byte registers per column, standard error
        ``1.04 / sqrt(m)``: 14 (the default) gives 0.81%, 16 gives 0.41%; 4 to 18.
      exact_up_to: count columns with at most this many distinct values exactly (keeps that
        many keys per column, 4 bytes each); None, the default: ``2^precision`` (64 KiB a
        column at the default precision); 0 turns it off (the estimate alone, which was the
        default before).
      datasketches: hash values as Apache DataSketches' HLL sketch does, so that the result's
        ``to_datasketches()`` writes HLL sketches Spark, Druid or the ``datasketches`` package merge
        (and :func:`~sharded_scan.from_datasketches` merges theirs in); its hash costs more: the
        estimate-only fold ran about 5 times slower on CPU (1.2 against 6.3 M rows/s).

    Values are compared as numpy's ``np.unique`` does: ``-0.0`` and ``0.0`` are one
    value, and all NaNs are one value (``nan_policy="propagate"``, the default; pandas'
    ``nunique(dropna=False)``); with ``nan_policy="omit"`` each NaN or Inf is skipped where it
    stands, the column's other values counted (pandas' ``nunique()``); ``"omit_rows"`` skips every
    row holding one. float64 and int64 values are compared exactly, by 64-bit keys: no two
    distinct values are counted as one.

    A string column is counted by its 64-bit :func:`~sharded_scan.hash_strings` ids: ``n`` distinct
    strings share an id with probability about ``n (n - 1) / 2^65``, so its count is marked ``exact``
    only up to 192,077 distinct strings (``topk_strings.EXACT_STRINGS``), where that is at most 1e-9;
    past it ``exact`` is False and ``relative_error`` the expected share lost, ``count / 2^65``.
    With ``datasketches=True`` a string's registers are DataSketches' ``hll_sketch.update(str)``'s
    (MurmurHash3 of its UTF-8 bytes; but DataSketches skips the empty string, which counts here).
    """

    precision: int = DEFAULT_PRECISION
    exact_up_to: int | None = None
    datasketches: bool = False
    string_ids: bool = False  # set by the engine for a string column's ids (datasketches: hashed as their strings)
    model_shards: int = 1  # set by for_mesh: above 1 each model device counts its block of the columns
    takes_string_ids = True  # string columns: their hash ids count the distinct strings
    state_type = DistinctAcc  # split over model: each device counts its block of the columns (column_split)

    def __post_init__(self):
        p = self.precision
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)) or not 4 <= p <= 18:
            raise UsageError(f"DistinctCount precision must be an integer in [4, 18] (2^p registers), got {p!r}.")
        if self.exact_up_to is None:
            object.__setattr__(self, "exact_up_to", 1 << int(p))
        e = self.exact_up_to
        if isinstance(e, bool) or not isinstance(e, (int, np.integer)) or e < 0:
            raise UsageError(f"DistinctCount exact_up_to must be an integer >= 0, got {e!r}.")
        if not isinstance(self.datasketches, bool | np.bool_):
            raise UsageError(f"DistinctCount datasketches must be True or False, got {self.datasketches!r}.")

    def check_spec(self, spec):
        check_column_spec(spec, "DistinctCount")
        if self.string_ids and np.dtype(spec.dtype) != np.int64:
            raise UsageError("DistinctCount(datasketches=True) hashes a string column as DataSketches does from its "
                             f"64-bit ids, and these are {np.dtype(spec.dtype).name}: leave the source's dtype unset.")

    def fingerprint(self):
        named = super().fingerprint()
        if not self.string_ids:  # as before the field: a checkpoint written then resumes
            del named["string_ids"]
        return named

    def for_string_ids(self) -> DistinctCount:
        """This count over a string column's :func:`~sharded_scan.hash_strings` ids: with ``datasketches``, each id
        hashed as DataSketches hashes its string (:func:`~.murmur.string_coupons`); else unchanged."""
        return dataclasses.replace(self, string_ids=True) if self.datasketches else self

    def init(self, spec):
        if self.model_shards > 1:
            return self.split(self.whole.init(spec))
        d, keys = (spec.shape[0] if spec.shape else 1), key_dtype(spec.dtype)
        slots = max(self.exact_up_to, 1)  # orbax cannot save an empty array: one unused slot when off
        return DistinctAcc(
            jnp.zeros((d, 1 << self.precision), jnp.uint8), jnp.full((d, slots), fill(keys), keys),
            jnp.zeros(spec.shape, jnp.int32),
        )

    def add(self, acc, batch, mask):
        if self.model_shards > 1:
            return acc._replace(value=self.whole.add(acc.value, self.own(batch), mask))
        return self._add(acc, batch, mask)

    def _add(self, acc, batch, mask):
        """Folds the rows ``mask`` ``(mb,)``, or each column's own values ``mask`` ``(d, mb)`` (:meth:`add_finite`)."""
        keys = columns(batch)

        def scatter(registers):
            index, rank = register_updates(keys, mask, self.precision, self._hash_code(batch), self.string_ids)
            rows = jnp.broadcast_to(jnp.arange(keys.shape[0])[:, None], index.shape)
            return registers.at[rows, index].max(rank)

        registers = fold_if_any(mask, scatter, acc.registers)
        if not self.exact_up_to:
            return acc._replace(registers=registers)
        def batch_keys():  # made inside the loop that keeps them, from the micro-batch as it is: no copy each time
            return jnp.where(per_column(mask), columns(batch), fill(keys.dtype))

        return self._add_held(acc, registers, batch_keys, jnp.sum(mask, axis=-1, dtype=jnp.int32), mask)

    def _hash_code(self, batch):
        """The key kind DataSketches' hash reads values as (``datasketches=True``), else None: our hash."""
        return KIND_DTYPES.index(keyed_as(batch.dtype)) if self.datasketches else None

    def _add_held(self, acc, registers, batch_keys, count, rows=None):
        """``acc`` with ``registers`` and, while some column keeps its values, the first ``count`` (``()``, or
        ``(d,)``: each column's own) of ``batch_keys()`` ``(d, mb)`` among them (``rows``: ``(mb,)`` or ``(d, mb)``,
        which of them are real, for the bound of :func:`more_than`; None: no bound, as for ``add_keyed``'s short
        chunks).

        Nothing is sorted once every column holds more than ``E`` values, nor for a micro-batch after which
        :func:`more_than` shows each column that would sort to hold more (so a column of many values sorts
        one micro-batch, its first); a fresh state sorts the micro-batch alone, not its ``E`` empty slots."""
        e = self.exact_up_to

        def kept(keys, held):
            valid, over, batch = held + count, held > e, batch_keys()
            if rows is not None and bound_bits(e, held.shape[0]):
                over |= jax.lax.cond(jnp.any(~over & (valid > e)),
                                     lambda: more_than(keys, held, batch, rows, e), lambda: over)

            def sort(keys):
                unique, n = unique_prefix(keys, valid, e)
                return unique, jnp.where(over, e + 1, jnp.minimum(n, e + 1))

            return jax.lax.cond(
                jnp.all(over), lambda: (keys, jnp.where(over, e + 1, held)),
                lambda: jax.lax.cond(jnp.all(held == 0), lambda: sort(batch),
                                     lambda: sort(jnp.concatenate([keys, batch], axis=1))))

        held = acc.held.reshape(-1)
        some = ~jnp.all(held > e) & (jnp.any(count > 0) if jnp.ndim(count) else count > 0)  # count: (d,) or ()
        keys, held = run_once(some, kept, acc.keys, held)
        return DistinctAcc(registers, keys, held.reshape(acc.held.shape))

    def omitting_values(self):
        """``self``: under ``nan_policy="omit"`` each column's count folds its own finite values
        (:meth:`add_finite`), a NaN or Inf skipped where it stands, the row's other values kept."""
        return self

    def finite_keep(self, batch, keep):
        """Every row of ``keep`` is folded: its NaN and Inf values are skipped where they stand."""
        return keep

    def add_finite(self, acc, batch, mask, keep):
        """``nan_policy="omit"`` (pandas' ``nunique()``): each column's registers and kept values fold the finite
        values of the rows ``keep``, by a mask per column ``(d, mb)`` where ``add`` takes one per row (the same
        scatter, bound and sorts, no ``jax.vmap``, whose ``lax.cond``s would run both branches: a one-column state
        folded alone would count the same)."""
        if self.model_shards > 1:
            return acc._replace(value=self.whole.add_finite(acc.value, self.own(batch), mask, keep))
        return self._add(acc, batch, finite_cells(batch, keep))

    def add_keyed(self, acc, batch, mask, keys, num_keys):
        """Registers per key in one scatter-max; the kept values of each key present in the micro-batch
        (while it has few) folded key by key (:func:`~.keys.fold_groups`)."""
        if self.model_shards > 1:
            return acc._replace(value=self.whole.add_keyed(acc.value, self.own(batch), mask, keys, num_keys))
        return self._add_keyed(acc, batch, mask, keys, num_keys)

    def add_keyed_finite(self, acc, batch, mask, keep, keys, num_keys):
        """:meth:`add_finite` per key: a key's rows sorted by value, each column's NaN and Inf (as the filler,
        which sorts last) after its finite values, which each window of its rows folds."""
        if self.model_shards > 1:
            value = self.whole.add_keyed_finite(acc.value, self.own(batch), mask, keep, keys, num_keys)
            return acc._replace(value=value)
        cells = finite_cells(batch, keep)
        return self._add_keyed(acc, batch, keep, keys, num_keys, None if cells.ndim == 1 else cells)

    def _add_keyed(self, acc, batch, mask, keys, num_keys, cells=None):
        """``cells``: each column's values to fold ``(d, mb)`` (:func:`~.keys.finite_cells`: float columns), else
        the rows ``mask``."""
        cols = columns(batch)
        index, rank = register_updates(cols, mask if cells is None else cells, self.precision,
                                       self._hash_code(batch), self.string_ids)
        d = cols.shape[0]
        group = jnp.broadcast_to(jnp.where(mask, keys, 0)[None, :], index.shape)
        rows = jnp.broadcast_to(jnp.arange(d)[:, None], index.shape)
        registers = acc.registers.at[group, rows, index].max(rank)
        if not self.exact_up_to:
            return acc._replace(registers=registers)
        values = per_column(mask if cells is None else cells)
        groups, cols = sort_by_key(jnp.where(values, cols, fill(cols.dtype)), mask, keys, num_keys)

        width = min(cols.shape[1], self.exact_up_to)

        def fold(one, start, n):
            def window():
                return run_window(cols, start, n, width)

            return self._add_held(one, one.registers, window, n if cells is None else real_values(window()))

        return fold_groups(fold, acc._replace(registers=registers), groups, num_keys, width)

    def merge(self, a, b):
        if self.model_shards > 1:  # column by column: each device merges its own columns
            return a._replace(value=self.whole.merge(a.value, b.value))
        registers = jnp.maximum(a.registers, b.registers)
        if not self.exact_up_to:
            return a._replace(registers=registers)
        e, a_held, b_held = self.exact_up_to, a.held.reshape(-1), b.held.reshape(-1)
        over = (a_held > e) | (b_held > e)

        def sort():
            merged = self._held(registers, jnp.concatenate([a.keys, b.keys], axis=1), a_held + b_held, a.held)
            return merged.keys, jnp.where(over, e + 1, merged.held.reshape(-1))

        # No sort where a side is empty or a column already holds more than E (every column: a merge of partials).
        alone = jnp.all(over | (a_held == 0) | (b_held == 0))
        keys, held = jax.lax.cond(alone, lambda: (jnp.where((b_held == 0)[:, None], a.keys, b.keys),
                                                  jnp.where(over, e + 1, a_held + b_held)), sort)
        return DistinctAcc(registers, keys, held.reshape(a.held.shape))

    def merge_collectives(self):
        """The estimate alone (``exact_up_to=0``): registers by maximum; the unused keys and counts
        stay the identity's on every shard (their maximum is it)."""
        if self.exact_up_to:
            return None
        return "max"

    def _held(self, registers, keys, valid, before):
        kept, count = unique_prefix(keys, valid, self.exact_up_to)
        held = jnp.where(before.reshape(-1) > self.exact_up_to, self.exact_up_to + 1,
                         jnp.minimum(count, self.exact_up_to + 1))
        return DistinctAcc(registers, kept, held.reshape(before.shape))

    def finalize(self, acc):
        if self.model_shards > 1:
            return self.whole.finalize(self.unsplit(acc))
        registers = np.asarray(acc.registers)
        held = np.asarray(acc.held).reshape(-1)
        exact = (held <= self.exact_up_to) & (self.exact_up_to > 0)
        rank_bits = murmur.MAX_RANK - 1 if self.datasketches else RANK_BITS
        estimates = np.array([estimate(r, rank_bits) for r in registers])
        count = np.where(exact, held, np.rint(estimates)).astype(np.int64)
        error = np.where(exact, 0.0, 1.04 / math.sqrt(registers.shape[1]))
        shape = np.shape(acc.held)
        state = hll_state(registers).reshape(shape) if self.datasketches else None
        return DistinctCountResult(count.reshape(shape), exact.reshape(shape), error.reshape(shape), state)
