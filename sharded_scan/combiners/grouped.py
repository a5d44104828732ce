"""Per-key reductions: any combiner accumulated once per integer key (``GROUP BY``).

:class:`GroupBy` runs on rows ``(keys, data)``: row ``i`` of ``data`` folds into the
accumulator of key ``keys[i]`` through the inner combiner's
:meth:`~sharded_scan.combiners.base.Combiner.add_keyed` (segment reductions for the
built-ins). The accumulator is the inner one with a leading axis of ``num_keys`` on every
leaf (one more, the ``other`` row, with ``out_of_range="other"``) and an exact row count per
key; it merges, checkpoints, resumes and splits over ``model`` as the inner one does.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner
from sharded_scan.combiners.passes import check_one_pass
from sharded_scan.combiners.results import pandas
from sharded_scan.combiners.wrappers import Wrapper
from sharded_scan.errors import UsageError

OUT_OF_RANGE = ("raise", "other")
OTHER_KEY = -1  # the key of the ``other`` row in a result


class GroupedAcc(NamedTuple):
    """The inner accumulator per key (leading axis) and the rows of each key (last: out of range)."""

    value: Any
    count: wide.Wide


class GroupByResult(NamedTuple):
    """The inner result per key.

    Attributes:
      result: the inner combiner's result with a leading axis of one entry per key on every
        field (``columns`` excepted); its fields are also this result's (``r.mean[k]``, and
        ``r.count[k]``: the inner result's ``count``, e.g. ``DistinctCount``'s distinct values).
      rows: rows per key (int64), as read: rows of weight 0 too (a ``Weighted`` inner result's own
        ``count`` leaves them out). (``count`` before: it hid the inner result's ``count``.)
      keys: the key of each entry: ``0..num_keys-1``, then ``-1`` for the ``other`` row
        (``out_of_range="other"``: rows whose key was outside ``[0, num_keys)``).
    """

    result: Any
    rows: np.ndarray
    keys: np.ndarray

    @property
    def count(self):
        """The inner result's ``count`` per key (``DistinctCount``'s distinct values, ``Sum``'s rows...), not
        the tuple's ``count`` method."""
        return self.result.count

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.result, name)

    def for_key(self, key: int) -> Any:
        """The inner result of ``key`` alone (``-1``: the ``other`` row)."""
        where = np.flatnonzero(self.keys == key)
        if not where.size:
            raise UsageError(f"no key {key!r} in this result; its keys are 0..{int(self.keys.max())}.")
        return entry(self.result, int(where[0]))

    def per_key(self, fn) -> GroupByResult:
        """This result with ``fn`` applied to each key's inner result (once, when all ``fn`` changes of
        the first key's is its ``columns``: the same names for every key)."""
        first = entry(self.result, 0)
        named = fn(first)
        if hasattr(named, "_fields") and all(a is b for f, a, b in zip(named._fields, named, first, strict=True)
                                             if f != "columns"):
            return self._replace(result=self.result._replace(columns=named.columns))
        return self._replace(result=stack([fn(entry(self.result, i)) for i in range(len(self.keys))]))

    def to_pandas(self):
        """A DataFrame of every key's inner ``to_pandas()`` stacked, indexed by ``key`` first,
        with the ``rows`` of each key first."""
        pd = pandas()
        frames = {}
        for i, key in enumerate(self.keys.tolist()):
            one = entry(self.result, i)
            frame = one.to_pandas() if hasattr(one, "to_pandas") else pd.DataFrame(np.atleast_2d(np.asarray(one)))
            if "rows" not in frame.columns:
                frame.insert(0, "rows", self.rows[i])
            frames[key] = frame
        return pd.concat(frames, names=["key", *frames[self.keys[0].item()].index.names])


def entry(stacked: Any, i: int) -> Any:
    """Entry ``i`` of a result stacked by :func:`stack` (``columns`` is not stacked)."""
    if hasattr(stacked, "_fields"):
        return type(stacked)(*[v if f == "columns" or v is None else entry(v, i)
                               for f, v in zip(stacked._fields, stacked, strict=True)])
    return jax.tree.map(lambda x: x[i], stacked)


def stack(results: list) -> Any:
    """One result whose every field holds ``results``' values along a leading axis (``columns``,
    the same for every key, once)."""
    first = results[0]
    if hasattr(first, "_fields"):
        return type(first)(*[v if f == "columns" or v is None else stack([r[i] for r in results])
                             for i, (f, v) in enumerate(zip(first._fields, first, strict=True))])
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *results)


def distinct_states(leaves: list, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The keys ``keys`` of the per-key accumulator ``leaves`` grouped by their state, byte for byte: the
    position in ``keys`` of each distinct state's first key, and each key's state's number. The keys that
    met no rows mostly hold the identity, but not all: ``Moments`` under ``nan_policy="omit"`` counts the
    NaN rows it skipped (``nan_count``) in a key whose every row was skipped."""
    rows = [np.ascontiguousarray(np.asarray(x)[keys]).reshape(len(keys), -1).view(np.uint8) for x in leaves]
    rows = np.concatenate([np.zeros((len(keys), 0), np.uint8)] + rows, axis=1)
    _, first, which = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    return first, which.reshape(-1)


def like_no_rows(result: Any) -> Any:
    """``result`` with every float value NaN and every integer 0: a key that met no rows."""

    def blank(x):
        x = np.asarray(x)
        if np.issubdtype(x.dtype, np.floating):
            return np.full_like(x, np.nan)
        return np.zeros_like(x) if np.issubdtype(x.dtype, np.integer) else x

    return jax.tree.map(blank, result)


def typed_like(blank: Any, template: Any) -> Any:
    """``blank`` (a key's result of no rows) with each float leaf that is an integer in ``template`` (a
    key's with rows: e.g. ``Quantiles(method="lower")`` of integers, NaN only with no rows) as that
    integer's zeros, so that stacking the keys never turns their integers into floats."""
    def one(b, t):
        b, t = np.asarray(b), np.asarray(t)
        whole = np.issubdtype(t.dtype, np.integer) and np.issubdtype(b.dtype, np.floating) and b.shape == t.shape
        return np.zeros_like(t) if whole else b

    if template is None or jax.tree.structure(blank) != jax.tree.structure(template):
        return blank
    return jax.tree.map(one, blank, template)


def check_num_keys(num_keys: Any) -> None:
    if isinstance(num_keys, bool) or not isinstance(num_keys, (int, np.integer)) or num_keys <= 0:
        raise UsageError(f"GroupBy num_keys must be a positive integer (keys are 0..num_keys-1), got {num_keys!r}.")


@dataclasses.dataclass(frozen=True)
class GroupBy(Wrapper):
    """``inner`` per integer key, on rows ``(keys, data)`` (``keys``: ``(rows,)`` integers).

    Attributes:
      inner: the combiner run per key on ``data`` (any combiner; ``Weighted(...)`` too).
      num_keys: keys run ``0..num_keys-1``.
      out_of_range: ``"raise"`` (a key outside ``[0, num_keys)`` is one line: before compute
        when the data is in memory, else when the run ends) or ``"other"`` (such rows fold into
        one more row of the result, key ``-1``).
    """

    num_keys: int = 0
    out_of_range: str = "raise"

    def __post_init__(self):
        if not isinstance(self.inner, Combiner):
            raise UsageError(f"GroupBy needs a sharded_scan Combiner to run per key, got {type(self.inner).__name__}.")
        check_one_pass(self.inner, "GroupBy")
        check_num_keys(self.num_keys)
        if self.out_of_range not in OUT_OF_RANGE:
            raise UsageError(f"GroupBy out_of_range must be one of {OUT_OF_RANGE}, got {self.out_of_range!r}.")

    @property
    def slots(self) -> int:
        """Accumulators per shard: one per key, and the ``other`` row when asked."""
        return self.num_keys + (self.out_of_range == "other")

    @property
    def takes_string_ids(self) -> bool:
        return self.inner.takes_string_ids

    @property
    def data_part(self) -> tuple[int, ...]:
        return (1, *self.inner.data_part)

    def fingerprint(self):
        return {"combiner": "GroupBy", "num_keys": repr(self.num_keys), "out_of_range": repr(self.out_of_range),
                "inner": self.inner.fingerprint()}

    def check_spec(self, spec):
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise UsageError("GroupBy runs on data (keys, data): a pair whose first item holds one integer key a row.")
        keys, data = spec
        if not isinstance(keys, jax.ShapeDtypeStruct) or keys.shape != ():
            shape = getattr(keys, "shape", type(keys).__name__)
            raise UsageError(f"GroupBy keys must be one integer a row (shape (rows,)), got rows of {shape}; "
                             "pass a 1-D array of keys.")
        if not np.issubdtype(np.dtype(keys.dtype), np.integer):
            raise UsageError(f"GroupBy keys must be integers, got {np.dtype(keys.dtype).name}; "
                             "map each group to an integer 0..num_keys-1 (e.g. pandas.factorize).")
        self.inner.check_spec(data)

    def check_rows(self, rows):
        keys = np.asarray(rows[0])
        if self.out_of_range == "raise" and keys.size:
            low, high = keys.min(), keys.max()
            if low < 0 or high >= self.num_keys:
                bad = int(np.count_nonzero((keys < 0) | (keys >= self.num_keys)))
                raise UsageError(
                    f"{bad} rows have keys outside 0..{self.num_keys - 1} (from {low} to {high}); pass "
                    f"num_keys={int(high) + 1 if low >= 0 else 'a larger value after remapping the keys'}, "
                    "or out_of_range='other' to count them in an 'other' row."
                )
        self.inner.check_rows(rows[1])

    def operands(self, spec):
        return self.inner.operands(spec[1])

    def partition(self, mesh):
        parts = self.inner.partition(mesh)
        if parts is None:
            return None
        return GroupedAcc(jax.tree.map(lambda p: P(None, *p), parts, is_leaf=lambda x: isinstance(x, P)), P())

    def convert(self, acc, source):
        return GroupedAcc(jax.vmap(lambda a: self.inner.convert(a, source.inner))(acc.value), acc.count)

    def init(self, spec):
        one = self.inner.init(spec[1])
        value = jax.tree.map(lambda x: jnp.broadcast_to(x[None], (self.slots, *x.shape)), one)
        return GroupedAcc(value, wide.zeros((self.num_keys + 1,)))

    def add(self, acc, batch, mask):
        return self.add_omitting(acc, batch, mask, mask)

    def add_omitting(self, acc, batch, mask, keep):
        """Folds the rows ``keep`` per key (``count`` counts them); ``inner`` sees ``mask``, the
        real rows, too (``Moments`` counts NaNs in those a ``nan_policy`` skips)."""
        return self._add(acc, batch, mask, keep, finite=False)

    def omitting_values(self):
        return self.rewrap(self.inner.omitting_values())

    def add_finite(self, acc, batch, mask, keep):
        """``nan_policy="omit"``: the inner combiner's :meth:`~Combiner.add_keyed_finite` per key; ``count``
        counts the rows it folds at all (a per-column statistic: every real row)."""
        return self._add(acc, batch, mask, self.inner.finite_keep(batch[1], keep), finite=True)

    def finite_keep(self, batch, keep):
        return self.inner.finite_keep(batch[1], keep)

    def _add(self, acc, batch, mask, keep, finite: bool):
        keys, data = batch
        inside = (keys >= 0) & (keys < self.num_keys)
        slot = jnp.where(inside, keys, self.num_keys).astype(jnp.int32)
        counts = jax.ops.segment_sum(keep.astype(jnp.int32), slot, self.num_keys + 1)
        ours = inside | (self.out_of_range == "other")  # the rows folded into a slot
        fold = self.inner.add_keyed_finite if finite else self.inner.add_keyed_omitting
        value = fold(acc.value, data, mask & ours, keep & ours, jnp.minimum(slot, self.slots - 1), self.slots)
        return GroupedAcc(value, wide.add_int32(acc.count, counts))

    def merge(self, a, b):
        return GroupedAcc(jax.vmap(self.inner.merge)(a.value, b.value), wide.add(a.count, b.count))

    def merge_collectives(self):
        """The inner combiner's, key by key (a leafwise reduction is one over every key at once)."""
        inner = self.inner.merge_collectives()
        return None if inner is None else GroupedAcc(inner, "sum_exact")

    def finalize(self, acc):
        count = np.asarray(wide.to_int(acc.count), np.int64)
        outside = int(count[self.num_keys])
        if self.out_of_range == "raise" and outside:
            problem = f"{outside} rows have keys outside 0..{self.num_keys - 1}"
            raise UsageError(
                f"{problem}; pass a larger num_keys, or out_of_range='other' to count them in an 'other' row.",
                cli=f"{problem}; pass a larger --config.combiner.kwargs.num_keys, or "
                    "--config.combiner.kwargs.out_of_range=other to count them in an 'other' row.",
            )
        count = count[: self.slots]
        leaves, tree = jax.tree.flatten(acc.value)
        results = [self.inner.finalize(tree.unflatten([x[k] for x in leaves])) if count[k] else None
                   for k in range(self.slots)]
        empty = np.flatnonzero(count == 0)
        if empty.size:  # one finalize per distinct state: a key whose every row was skipped still says so
            template = next((r for r in results if r is not None), None)
            first, which = distinct_states(leaves, empty)
            blanks = [self._no_rows_result(acc.value, int(empty[i]), template) for i in first]
            for k, i in zip(empty, which, strict=True):
                results[k] = blanks[i]
        keys = np.arange(self.slots)
        if self.out_of_range == "other":
            keys[-1] = OTHER_KEY
        return GroupByResult(stack(results), count, keys)

    def _no_rows_result(self, value, k: int, template):
        """The inner result of a key that met no rows: the inner finalize of its (identity)
        accumulator, without numpy's warnings of empty means; where that is an error (a fit
        of no rows), ``template`` with NaN for every float."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                return typed_like(self.inner.finalize(jax.tree.map(lambda x: x[k], value)), template)
        except UsageError:
            if template is None:
                raise
            return like_no_rows(template)
