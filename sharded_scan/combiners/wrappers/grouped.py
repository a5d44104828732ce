"""Per-key reductions: any combiner accumulated once per key (``GROUP BY``).

:class:`GroupBy` runs on rows ``(keys, data)``: row ``i`` of ``data`` folds into the
accumulator of key ``keys[i]`` through the inner combiner's
:meth:`~sharded_scan.combiners.base.Combiner.add_keyed` (segment reductions for the
built-ins). The accumulator is the inner one with a leading axis of ``num_keys`` on every
leaf (one more, the ``other`` row, with ``out_of_range="other"``) and an exact row count per
key; it merges, checkpoints, resumes and splits over ``model`` as the inner one does.

Keys by value (``num_keys`` not given: strings, integers of any width, bools, categoricals): the run
finds the distinct keys before compute and reads each row's key as its rank among them, a dense slot
(:mod:`sharded_scan.group_keys`); the combiner then holds the sorted key values (``key_values``), so the
device programs are the dense ones of ``num_keys`` = the number of keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner, folding_per_key
from sharded_scan.combiners.keyed_sums import keyed_sum
from sharded_scan.combiners.passes import check_one_pass
from sharded_scan.combiners.results import pandas
from sharded_scan.combiners.wrappers.policies import Wrapper
from sharded_scan.errors import UsageError

OUT_OF_RANGE = ("raise", "other")
OTHER_KEY = -1  # the key of the ``other`` row in a result
DEFAULT_MAX_KEYS = 100_000  # keys by value: the distinct keys a run takes unless max_keys= says otherwise
MISSING = -1  # keys by value: the slot of a missing key (NaN, None): the row is dropped, as pandas' dropna=True
# (outside 0..num_keys-1: counted in the out-of-range count, folded nowhere; the device programs are the dense ones)


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
        (``out_of_range="other"``: rows whose key was outside ``[0, num_keys)``); keys by value: the
        distinct keys themselves, sorted as pandas sorts them (strings as an object array of ``str``,
        integers in their own dtype, a categorical's in its categories' order).
      by: the name of the keys' column where the data names it (``to_pandas()``'s index level), else None.
    """

    result: Any
    rows: np.ndarray
    keys: np.ndarray
    by: str | None = None

    @property
    def count(self):
        """The inner result's ``count`` per key (``DistinctCount``'s distinct values, ``Sum``'s rows...), not
        the tuple's ``count`` method."""
        return self.result.count

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.result, name)

    def for_key(self, key: Any) -> Any:
        """The inner result of ``key`` alone (``-1``: the ``other`` row; keys by value: the key, e.g. ``"Oslo"``)."""
        key = key.item() if isinstance(key, np.generic) else key  # np.str_("a") is "a", np.int64(3) is 3
        where = [i for i, k in enumerate(self.keys.tolist()) if type(k) is type(key) and k == key] or (
            np.flatnonzero(self.keys == key).tolist() if self.keys.dtype != object else [])
        if not where:
            shown = ", ".join(map(repr, self.keys[:5].tolist())) + (", ..." if len(self.keys) > 5 else "")
            raise UsageError(f"no key {key!r} in this result; its keys are {shown}.")
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
        """A DataFrame of every key's inner ``to_pandas()`` stacked, indexed by the key first (the level
        named ``by``, else ``key``; the keys themselves, in order: ``df.groupby(by)``'s), with the ``rows`` of
        each key first."""
        pd = pandas()
        frames = []
        for i in range(len(self.keys)):
            one = entry(self.result, i)
            frame = one.to_pandas() if hasattr(one, "to_pandas") else pd.DataFrame(np.atleast_2d(np.asarray(one)))
            if "rows" not in frame.columns:
                frame.insert(0, "rows", self.rows[i])
            frames.append(frame)
        return pd.concat(frames, keys=pd.Index(self.keys), names=[self.by or "key", *frames[0].index.names])


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
    rows = np.concatenate([np.zeros((len(keys), 1), np.uint8)] + rows, axis=1)
    # each row one opaque value of its bytes: np.unique(axis=0) would sort a record of one field a byte
    # (seconds for a sketch's state of a few hundred kB)
    rows = np.ascontiguousarray(rows).view(np.dtype((np.void, rows.shape[1]))).reshape(-1)
    _, first, which = np.unique(rows, return_index=True, return_inverse=True)
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


def check_num_keys(num_keys: Any, name: str = "num_keys", means: str = "keys are 0..num_keys-1") -> None:
    if isinstance(num_keys, bool) or not isinstance(num_keys, (int, np.integer)) or num_keys <= 0:
        raise UsageError(f"GroupBy {name} must be a positive integer ({means}), got {num_keys!r}.")
    if num_keys >= 2**31 - 1:
        raise UsageError(f"GroupBy {name}={num_keys} is past the 2^31 - 2 keys a run holds; pass a smaller one.")


def too_many_keys(found: int, max_keys: int, where: str = "") -> UsageError:
    """The one line of a key set larger than ``max_keys`` (``found``: at least so many)."""
    problem = f"the GroupBy keys hold {where}{found} distinct values, more than max_keys={max_keys}"
    return UsageError(f"{problem}; pass GroupBy(..., max_keys=N) with N >= the number of distinct keys "
                      "(each key holds the inner combiner's state on every device).",
                      cli=f"{problem}; pass --config.combiner.kwargs.max_keys=N with N >= the number of distinct keys.")


def keys_digest(values: np.ndarray) -> str:
    """SHA-256 of the key values and their dtype (the fingerprint of a GroupBy of keys by value)."""
    text = json.dumps([str(values.dtype), [v if isinstance(v, (str, int, bool)) else repr(v)
                                           for v in values.tolist()]])
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@dataclasses.dataclass(frozen=True)
class GroupBy(Wrapper):
    """``inner`` per key, on rows ``(keys, data)`` (``keys``: one key a row), or on a DataFrame or
    tabular source grouped ``by`` one of its columns.

    Attributes:
      inner: the combiner run per key on ``data`` (any combiner; ``Weighted(...)`` too).
      num_keys: dense integer keys ``0..num_keys-1`` (the fastest: no key is looked up); None (the default):
        keys by value, below.
      out_of_range: dense keys: ``"raise"`` (a key outside ``[0, num_keys)`` is one line: before compute
        when the data is in memory, else when the run ends) or ``"other"`` (such rows fold into
        one more row of the result, key ``-1``).
      max_keys: keys by value (``num_keys`` None): keys of any type (integers of any width, strings,
        bools, pandas categoricals; from files, string and integer columns), at most ``max_keys`` distinct ones
        (default 100,000, ``DEFAULT_MAX_KEYS``; more is one line before compute). The run reads the keys once
        before compute and groups by their values; the result's ``keys`` are those values, sorted as pandas
        sorts them; a missing key (NaN, None) drops its row, as pandas' ``groupby(dropna=True)``.
      by: the name of the keys' column when the data is a DataFrame or a Parquet/CSV source: the rows are
        ``(that column, the other columns)``, as ``df.groupby(by)``.
      key_values: not an argument: set by the run (keys by value, :meth:`with_keys`): the sorted distinct keys,
        slot ``i`` holding key ``key_values[i]``; equality and hash ignore it (the programs do not read it), the
        fingerprint names it.
      key_name: not an argument: set by the run: the keys' column name, if any.
    """

    num_keys: int | None = None
    out_of_range: str = "raise"
    max_keys: int | None = None
    by: str | None = None
    key_values: Any = dataclasses.field(default=None, init=False, compare=False, repr=False)
    key_name: str | None = dataclasses.field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.inner, Combiner):
            raise UsageError(f"GroupBy needs a sharded_scan Combiner to run per key, got {type(self.inner).__name__}.")
        check_one_pass(self.inner, "GroupBy")
        if self.out_of_range not in OUT_OF_RANGE:
            raise UsageError(f"GroupBy out_of_range must be one of {OUT_OF_RANGE}, got {self.out_of_range!r}.")
        if self.by is not None and not isinstance(self.by, str):
            raise UsageError(f"GroupBy by= names one column (a str), got {self.by!r}.")
        if self.num_keys is None:
            check_num_keys(self.bound, "max_keys", "the most distinct keys the data may hold")
            if self.out_of_range != "raise":
                raise UsageError("GroupBy out_of_range='other' is for dense keys (num_keys=N); keys by value "
                                 "(max_keys) give every key its own row.")
            return
        check_num_keys(self.num_keys)
        if self.max_keys is not None:
            raise UsageError(f"GroupBy takes num_keys={self.num_keys} (dense integer keys 0..num_keys-1) or max_keys="
                             f"{self.max_keys} (keys of any type, grouped by value), not both; drop one.")

    @property
    def by_value(self) -> bool:
        """Whether keys are grouped by value (``num_keys`` not given), found by the run before compute."""
        return self.num_keys is None or self.key_values is not None

    @property
    def bound(self) -> int:
        """Keys by value: the most distinct keys the run takes."""
        return DEFAULT_MAX_KEYS if self.max_keys is None else self.max_keys

    def with_keys(self, values: np.ndarray, name: str | None) -> GroupBy:
        """This GroupBy bound to the distinct keys ``values`` (sorted: slot ``i`` is ``values[i]``): equal to
        ``GroupBy(inner, len(values))``, whose compiled programs it shares (its fingerprint names the keys)."""
        bound = dataclasses.replace(self, num_keys=len(values), max_keys=None, by=None)
        object.__setattr__(bound, "key_values", values)  # not arguments: set by the run alone
        object.__setattr__(bound, "key_name", name)
        return bound

    def rewrap(self, inner: Combiner) -> GroupBy:
        """The same GroupBy (its keys found too) around ``inner``."""
        new = dataclasses.replace(self, inner=inner)
        if self.key_values is not None:
            new = new.with_keys(self.key_values, self.key_name)
        return new

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
        found = {} if self.key_values is None else {"keys": keys_digest(self.key_values), "by": repr(self.key_name)}
        return {"combiner": "GroupBy", "num_keys": repr(self.num_keys), "out_of_range": repr(self.out_of_range),
                **found, "inner": self.inner.fingerprint()}

    def check_spec(self, spec):
        if self.num_keys is None:
            raise UsageError("GroupBy without num_keys groups by the keys' values, which sharded_scan.run (or "
                             "run_in_workdir) finds before compute; run it through them, or pass num_keys=N for "
                             "integer keys 0..N-1.")
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise UsageError("GroupBy runs on data (keys, data): a pair whose first item holds one integer key a row.")
        keys, data = spec
        if not isinstance(keys, jax.ShapeDtypeStruct) or keys.shape != ():
            shape = getattr(keys, "shape", type(keys).__name__)
            raise UsageError(f"GroupBy keys must be one integer a row (shape (rows,)), got rows of {shape}; "
                             "pass a 1-D array of keys.")
        if not np.issubdtype(np.dtype(keys.dtype), np.integer):
            raise UsageError(f"GroupBy(num_keys=N) keys must be integers 0..N-1, got {np.dtype(keys.dtype).name}; "
                             "leave num_keys out to group by the keys' values (any type; max_keys= bounds them).")
        self.inner.check_spec(data)

    def check_rows(self, rows):
        keys = np.asarray(rows[0])
        if self.out_of_range == "raise" and keys.size and self.key_values is None:
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
        counts = keyed_sum(keep.astype(jnp.int32), slot, self.num_keys + 1)
        ours = inside | (self.out_of_range == "other")  # the rows folded into a slot
        fold = self.inner.add_keyed_finite if finite else self.inner.add_keyed_omitting
        with folding_per_key():  # a KLL sketch's small windows kept for its many small insertions
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
        outside = int(count[self.num_keys])  # keys by value: the rows of a missing key (MISSING), dropped
        if self.out_of_range == "raise" and outside and self.key_values is None:
            problem = f"{outside} rows have keys outside 0..{self.num_keys - 1}"
            raise UsageError(
                f"{problem}; pass a larger num_keys, or out_of_range='other' to count them in an 'other' row.",
                cli=f"{problem}; pass a larger --config.combiner.kwargs.num_keys, or "
                    "--config.combiner.kwargs.out_of_range=other to count them in an 'other' row.",
            )
        count = count[: self.slots]
        keys = self.key_values
        if keys is None:
            keys = np.arange(self.slots)
            if self.out_of_range == "other":
                keys[-1] = OTHER_KEY
        if self.inner.finalizes_stacked:  # every key in one call (Sum, Moments), not 1,000 calls for 1,000 keys
            value = jax.tree.map(lambda x: np.asarray(x)[: self.slots], acc.value)
            return GroupByResult(self._stacked_result(value, count == 0), count, keys, self.key_name)
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
        return GroupByResult(stack(results), count, keys, self.key_name)

    def _stacked_result(self, value, empty: np.ndarray):
        """The inner results of every key (``finalizes_stacked``) in one finalize, those of the keys that met no
        rows (``empty``) in another, without numpy's warnings of empty means, as key by key."""
        def of(which, quiet: bool):
            with warnings.catch_warnings():
                if quiet:
                    warnings.simplefilter("ignore", RuntimeWarning)
                return jax.tree.map(np.asarray, self.inner.finalize(jax.tree.map(lambda x: x[which], value)))

        if not empty.any() or empty.all():
            return of(slice(None), bool(empty.all()))

        def joined(rows, blank):
            out = np.empty((len(empty), *rows.shape[1:]), np.result_type(rows, blank))
            out[~empty], out[empty] = rows, blank
            return out

        return jax.tree.map(joined, of(~empty, False), of(empty, True))

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
