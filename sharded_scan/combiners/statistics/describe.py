"""``Describe``: pandas' ``df.describe()`` of every column in one pass, mergeable and resumable.

Per column: the values that are not NaN (``count``), the NaNs (``nan_count``), their mean,
standard deviation (``ddof=1``, as pandas), min, max and percentiles, NaN skipped column by
column as pandas does (a NaN in one column does not hide the row's other values).

Built from the existing accumulators: each column is a one-column :class:`Moments` state whose
rows are masked where that column is NaN (all folded at once, by ``FiniteMoments``' fold), and the
percentiles come from one :class:`Quantiles` sketch of all the columns, in which NaN's key
sorts after every value: with ``count`` values in a column, its percentile ``q`` is read at
ranks around ``q (count - 1)`` (numpy's ``"linear"``, as pandas), below every NaN.
``exact=True`` refines the sketch's answers in further passes like ``Quantiles(exact=True)``.

On a mesh with a ``model`` axis of size M (``model_shards``, set by :meth:`Describe.for_mesh`) the
one-pass state is split by columns: each device holds the stacked moments and the sketch
(``Quantiles``' split) of ``ceil(d / M)`` columns, padded with empty ones to a multiple of M. A
split state is one :class:`DescribeAcc` whose leaves are trees shaped like the data (the per-leaf
accumulators transposed), so that its ``partition`` is a prefix of it whatever the data's tree.
``exact=True``'s passes split the same way: the sketch pass as this state, each refining pass's
bin counts by columns (:class:`~sharded_scan.combiners.sketches.quantiles_exact.RefinePass`, one per leaf in
an :class:`Each`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sharded_scan.combiners import wide
from sharded_scan.combiners.base import Combiner, nonfinite_as_nan
from sharded_scan.combiners.column_split import SplitsByColumns, column_block, round_up
from sharded_scan.combiners.passes import MultiPass
from sharded_scan.combiners.results import frame, json_text, json_value
from sharded_scan.combiners.sketches import kll
from sharded_scan.combiners.sketches.keys import check_column_spec
from sharded_scan.combiners.sketches.quantiles import (
    CONFIDENCE,
    DEFAULT_K,
    Quantiles,
    check_qs,
    sketch_picks,
    split,
    unsplit,
)
from sharded_scan.combiners.sketches.quantiles_exact import Brackets, RefinePass, SketchPass
from sharded_scan.combiners.sketches.quantiles_result import QuantilesAcc, method_ranks, values_from_keys
from sharded_scan.combiners.statistics.moments import Moments, MomentsAcc, column_states, one_state
from sharded_scan.errors import UsageError
from sharded_scan.mesh import MODEL_AXIS

COLUMN = Moments(ddof=1, fields=("mean", "var", "min", "max"))  # what df.describe() reads of a column
EACH_COLUMN = COLUMN.omitting_values()  # every column's values at once, each counted on its own
METHOD = "linear"  # pandas' percentiles
FORMAT = "sharded_scan.describe/1"
DESCRIBE_JSON = "describe.json"  # what the CLI's Describe job writes next to result.npz


class DescribeResult(NamedTuple):
    """One array of rows' ``df.describe()``: per column (``(d,)``; ``(d, len(qs))`` for the percentiles).

    ``count`` (int64) counts the values that are not NaN and ``nan_count`` the NaNs; ``mean``,
    ``std`` (``ddof=1``), ``min``, ``max`` and ``percentiles`` (float64) skip the NaNs and are
    NaN for a column of none (``count`` 0). ``percentiles[:, i]`` is the column's ``qs[i]``
    quantile (numpy's ``"linear"``, as pandas); ``rank_error`` bounds each one's
    ``|rank - q (count - 1)| / count`` with probability 0.99 (0: exact); ``passes`` counts the
    passes over the data.
    """

    count: np.ndarray
    nan_count: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray
    percentiles: np.ndarray
    qs: np.ndarray
    rank_error: np.ndarray
    passes: np.ndarray
    columns: np.ndarray | None = None  # the columns' names (a DataFrame, Parquet, CSV), else np.arange(d)

    def to_pandas(self):
        """``df.describe()``'s table: rows ``count, mean, std, min, <percentiles>, max``, a column per column."""
        fields = (("count", self.count.astype(np.float64)), "mean", "std", "min", "percentiles", "max")
        return frame(self, fields, spread={"percentiles": [percent(q) for q in self.qs]}).T

    def to_json(self, path: str | os.PathLike) -> dict[str, Any]:
        """Writes the per-feature statistics a training pipeline normalizes with to ``path`` (JSON;
        a local path, or an ``etils.epath.Path`` for a URL).

        The file (also returned)::

            {"format": "sharded_scan.describe/1",
             "features": {NAME: {"count": int, "nan_count": int, "mean": float, "std": float,
                                 "min": float, "max": float, "q25": float, ...}},
             "qs": [0.25, ...], "rank_error": {NAME: float}, "passes": int}

        ``q<P>`` is the ``P`` percent quantile, named as :func:`percentile_key` writes it
        (``q01``, ``q50``, ``q99``, ``q99.9``). Strict JSON in the project's one spelling
        (:func:`~sharded_scan.combiners.results.json_value`): NaN (a column of no values) is
        null, an infinity (a column holding one: its ``max``, ``min``, percentiles) the string
        ``"inf"`` or ``"-inf"``.
        """
        table = as_json(self)
        target = path if hasattr(path, "write_text") else pathlib.Path(path)
        target.write_text(describe_json(self))
        return table


def percent(q: float) -> str:
    """pandas' label of the ``q`` quantile in ``describe()``: ``0.25`` -> ``"25%"``."""
    return f"{float(np.round(q * 100, 10)):g}%"


def percentile_key(q: float) -> str:
    """The JSON key of the ``q`` quantile: ``q`` and its percent, two digits at least (``q01``, ``q99.9``)."""
    value = float(np.round(q * 100, 10))
    whole = f"{value:g}"
    return f"q{int(value):02d}" if value == int(value) else f"q{whole}"


def as_json(result: DescribeResult) -> dict[str, Any]:
    """The content :meth:`DescribeResult.to_json` writes (JSON values: :func:`json_value`'s NaN and infinities)."""
    names = [str(n) for n in (result.columns if result.columns is not None and len(result.columns)
                              else range(len(result.count)))]
    features = {}
    for j, name in enumerate(names):
        row = {f: json_value(getattr(result, f)[j]) for f in ("count", "nan_count", "mean", "std", "min", "max")}
        row.update({percentile_key(q): json_value(result.percentiles[j, i]) for i, q in enumerate(result.qs)})
        features[name] = row
    return {
        "format": FORMAT, "features": features, "qs": [float(q) for q in result.qs],
        "rank_error": {name: json_value(np.float64(result.rank_error[j])) for j, name in enumerate(names)},
        "passes": int(result.passes),
    }


def describe_json(result: DescribeResult) -> str:
    """The text :meth:`DescribeResult.to_json` writes (the CLI's ``describe.json``)."""
    return json_text(as_json(result), indent=1) + "\n"


class DescribeAcc(NamedTuple):
    """One array of rows: a one-column Moments per column (stacked), one sketch of every column."""

    moments: MomentsAcc
    sketch: QuantilesAcc


def _is_acc(x) -> bool:
    return isinstance(x, DescribeAcc)


def _columns(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0], -1)


def _gathered(accs: Any) -> DescribeAcc:
    """A tree of per-leaf accumulators as one :class:`DescribeAcc` whose leaves are trees shaped like the data."""
    leaves, outer = jax.tree.flatten(accs, is_leaf=_is_acc)
    return jax.tree.transpose(outer, jax.tree.structure(leaves[0]), accs)


def _per_leaf(acc: DescribeAcc) -> Any:
    """:func:`_gathered`'s inverse: the tree of per-leaf accumulators."""
    outer = jax.tree.structure(acc.moments.min)  # a tree shaped like the data
    inner = jax.tree.structure(jax.tree.map(lambda _: 0, acc, is_leaf=lambda x: jax.tree.structure(x) == outer))
    return jax.tree.transpose(inner, outer, acc)


def _stacked(moments: MomentsAcc, d: int) -> MomentsAcc:
    """Stacked one-column moments of ``d`` columns: those of ``moments``, then empty ones."""
    one = COLUMN.init(jax.ShapeDtypeStruct((1,), moments.min.dtype))
    pad = d - np.shape(moments.min)[0]
    return jax.tree.map(lambda x, e: jnp.concatenate([x, jnp.broadcast_to(e, (pad, *e.shape))]), moments, one)


@dataclasses.dataclass(frozen=True)
class Describe(SplitsByColumns, Combiner, MultiPass):
    """pandas' ``df.describe()`` per column: count, NaNs, mean, std, min, max and percentiles.

    Takes an array of rows ``(n, d)`` or ``(n,)`` (one column), or a pytree of them such as
    ``(X, y)``, and returns a :class:`DescribeResult` per array (a pytree of them, shaped
    like the data). ``result.to_pandas()`` is ``df.describe()``'s table, ``result.to_json(path)``
    writes the per-feature statistics (its docstring gives the format).

    Args:
      percentiles: the quantiles to report, each in ``[0, 1]`` (sorted, as pandas reports
        them; pandas before 3.0 also added the median).
      exact: the exact percentiles (``np.nanquantile``'s), in a few more passes over the data,
        like ``Quantiles(exact=True)``; else the sketch's, with their ``rank_error``.
      k: the sketch size (``Quantiles``' accuracy knob).
      bits: with ``exact``, bits each further pass narrows by (``Quantiles``').

    NaN is skipped column by column, as pandas does; infinities count as values (in
    ``count``, ``min``, ``max`` and the percentiles; a column holding one has pandas' mean,
    ``inf``, ``-inf`` or NaN when it holds both, and a NaN std, as ``Moments``). Under
    ``nan_policy="omit"`` an infinity is skipped where it stands as a NaN is (``count`` the
    column's finite values, ``nan_count`` those skipped); ``"omit_rows"`` skips every row holding one.

    On a mesh with a ``model`` axis the one-pass state is split by columns (the module's docstring).
    """

    percentiles: Any = (0.25, 0.5, 0.75)
    exact: bool = False
    # Its add masks every column's NaNs anyway: a mask-free scan saves little per step, and a second
    # scan doubles the step's tracing and compiling (most of a small job's time).
    one_scan_per_step = True
    compiles_less_when_short = True  # its sketch's (Quantiles')
    k: int = DEFAULT_K
    bits: int = 10
    model_shards: int = 1  # set by for_mesh: above 1 each model device holds its block of the columns

    def __post_init__(self):
        qs = check_qs(self.percentiles, None, "Describe")
        object.__setattr__(self, "percentiles", tuple(sorted(set(qs))))
        Quantiles(qs=self.percentiles, k=self.k, exact=self.exact, bits=self.bits)  # checks them as Quantiles does

    @property
    def sketch(self) -> Quantiles:
        """The one-pass sketch of every column's keys (a NaN's key sorts last)."""
        return Quantiles(qs=self.percentiles, k=self.k, method=METHOD, model_shards=self.model_shards)

    def fingerprint(self):
        # the columns' moments are part of the state: a checkpoint of another field set is another job
        return {**super().fingerprint(), "moments": repr(COLUMN.fields)}

    def check_spec(self, spec):
        for leaf in jax.tree.leaves(spec):
            check_column_spec(leaf, "Describe")

    def partition(self, mesh):
        if self.model_shards == 1:
            return None
        return DescribeAcc(P(MODEL_AXIS), self.sketch.partition(mesh))

    def _leafwise(self, fn, acc, *trees):
        """``fn`` over the per-leaf accumulators of ``acc`` (and leaves of ``trees``), split or whole."""
        split = self.model_shards > 1
        accs = jax.tree.map(fn, _per_leaf(acc) if split else acc, *trees, is_leaf=_is_acc)
        return _gathered(accs) if split else accs

    def init(self, spec):
        def leaf(s):
            d = s.shape[0] if s.shape else 1
            one = COLUMN.init(jax.ShapeDtypeStruct((1,), s.dtype))
            moments = jax.tree.map(lambda a: jnp.broadcast_to(a, (round_up(d, self.model_shards), *a.shape)), one)
            return DescribeAcc(moments, self.sketch.init(s))

        accs = jax.tree.map(leaf, spec)
        return _gathered(accs) if self.model_shards > 1 else accs

    def add(self, acc, batch, mask):
        def leaf(a, x):
            x = _columns(x)
            own = column_block(x, self.model_shards) if self.model_shards > 1 else x  # padding: zeros, not read
            valid = mask[:, None] & ~jnp.isnan(own)
            # Each column's values folded as its own one-column state would fold them, by the state of every
            # column that keeps a count a column (not a vmap of one-column folds, whose conds run both branches).
            moments = column_states(EACH_COLUMN.fold(one_state(a.moments), own, valid))
            return DescribeAcc(moments, self.sketch.add(a.sketch, x, mask))

        return self._leafwise(leaf, acc, batch)

    def finite_values(self, batch):
        """``nan_policy="omit"``: an inf skipped where it stands, as a NaN (``count`` its column's finite
        values, ``nan_count`` the values skipped)."""
        return nonfinite_as_nan(batch)

    def merge(self, a, b):
        def leaf(x, y):
            return DescribeAcc(jax.vmap(COLUMN.merge)(x.moments, y.moments), self.sketch.merge(x.sketch, y.sketch))

        return self._leafwise(leaf, a, _per_leaf(b) if self.model_shards > 1 else b)

    def convert(self, acc, source):
        """Between the whole state and one split over ``model`` (a resume on a mesh with other axes)."""
        def whole(a):
            d = np.shape(a.sketch.columns)
            return DescribeAcc(jax.tree.map(lambda x: x[: d[0] if d else 1], a.moments), unsplit(a.sketch))

        def there(a):
            d = np.shape(a.moments.min)[0]
            return DescribeAcc(_stacked(a.moments, round_up(d, self.model_shards)), split(a.sketch, self.model_shards))

        accs = jax.tree.map(whole, _per_leaf(acc), is_leaf=_is_acc) if source.model_shards > 1 else acc
        return _gathered(jax.tree.map(there, accs, is_leaf=_is_acc)) if self.model_shards > 1 else accs

    def finalize(self, acc):
        acc = self.whole.convert(acc, self)
        return jax.tree.map(lambda a: self._result(a, None, 1), acc, is_leaf=_is_acc)

    @property
    def needs_passes(self) -> bool:
        return bool(self.exact)

    def passes(self):
        one_pass = dataclasses.replace(self, exact=False)
        acc = yield SketchPass(one_pass)
        leaves, tree = jax.tree.flatten(acc, is_leaf=_is_acc)
        qs, nq = np.asarray(self.percentiles), len(self.percentiles)
        brackets = []
        for a in leaves:
            count = _moments(a)[0]
            low, high, _ = method_ranks(qs, count[:, None], METHOD)
            ends = np.tile(qs, 2)[None, :]
            settled = (ends == 0) | (ends == 1) | (count[:, None] == 0)
            brackets.append(Brackets(a.sketch, np.concatenate([low, high], axis=1), settled, self.bits))
        passes = 1
        while any(b.open for b in brackets):
            bounds = [b.bounds() for b in brackets]
            counts = yield Each(tuple(RefinePass(x) for x in bounds), tree)
            for b, x, c in zip(brackets, bounds, tree.flatten_up_to(counts), strict=True):
                b.narrow(x, c)
            passes += 1
        results = [self._result(a, (b.keys[:, :nq], b.keys[:, nq:]), passes)
                   for a, b in zip(leaves, brackets, strict=True)]
        return tree.unflatten(results)

    def _result(self, acc: DescribeAcc, keys, passes: int) -> DescribeResult:
        """The result of one array of rows from its merged accumulator; ``keys``: the exact
        passes' keys at the low and high ranks (None: read the sketch)."""
        count, mean, var, low, high = _moments(acc)
        qs = np.asarray(self.percentiles)
        sketch = acc.sketch
        rows = int(wide.to_int(sketch.count))
        weight = method_ranks(qs, count[:, None], METHOD)[2]  # (d, len(qs))
        if keys is None:
            keys = sketch_picks(kll.to_host(sketch.sketch), qs, count[:, None], METHOD)[:2]
            bound = kll.rank_error_bound(float(sketch.sketch.variance), rows, CONFIDENCE)
            with np.errstate(divide="ignore", invalid="ignore"):
                error = np.where(count > 0, bound * rows / np.maximum(count, 1), 0.0)
        else:
            error = np.zeros(len(count))
        values = values_from_keys(sketch, qs, keys[0], keys[1], weight)
        values = np.where(qs[None, :] == 0, low[:, None], np.where(qs[None, :] == 1, high[:, None], values))
        values[count == 0] = np.nan
        return DescribeResult(count, rows - count, mean, np.sqrt(var), low, high, values, qs.copy(), error,
                              np.int64(passes))


def _moments(acc: DescribeAcc) -> tuple[np.ndarray, ...]:
    """Per column (float64 ``(d,)``; count int64): count, mean, variance, min, max."""
    with warnings.catch_warnings():  # a column of no values is NaN, reported by its count of 0
        warnings.simplefilter("ignore", RuntimeWarning)
        # every column in one call (stacked: the column axis first), each as its own call's
        r = COLUMN.finalize(jax.tree.map(np.asarray, acc.moments))
    return (np.asarray(r.count, np.int64), *(np.asarray(getattr(r, f)[:, 0], np.float64)
                                             for f in ("mean", "var", "min", "max")))


@dataclasses.dataclass(frozen=True)
class Each(Combiner):
    """A combiner per leaf of the data (``parts`` in the order of ``tree``'s leaves): their
    accumulators and results a pytree shaped like the data."""

    parts: tuple[Combiner, ...]
    tree: Any  # the data's treedef

    def check_spec(self, spec):
        if jax.tree.structure(spec) != self.tree:
            raise UsageError(f"Each needs data shaped like {self.tree}, got {jax.tree.structure(spec)}.")
        for part, leaf in zip(self.parts, jax.tree.leaves(spec), strict=True):
            part.check_spec(leaf)

    def fingerprint(self):
        return {"combiner": "Each", "parts": [p.fingerprint() for p in self.parts], "tree": str(self.tree)}

    def _each(self, fn, *trees):
        leaves = [self.tree.flatten_up_to(t) for t in trees]
        return self.tree.unflatten([fn(p, *xs) for p, *xs in zip(self.parts, *leaves, strict=True)])

    def operands(self, spec):
        return tuple(p.operands(s) for p, s in zip(self.parts, jax.tree.leaves(spec), strict=True))

    def for_mesh(self, mesh):
        return dataclasses.replace(self, parts=tuple(p.for_mesh(mesh) for p in self.parts))

    def partition(self, mesh):
        parts = [p.partition(mesh) for p in self.parts]
        if all(p is None for p in parts):
            return None
        return self.tree.unflatten([P() if p is None else p for p in parts])  # None: that part whole

    def convert(self, acc, source):
        return self.tree.unflatten([p.convert(a, s) for p, s, a in
                                    zip(self.parts, source.parts, self.tree.flatten_up_to(acc), strict=True)])

    def bind(self, operands):
        return dataclasses.replace(self, parts=tuple(p.bind(o) for p, o in zip(self.parts, operands, strict=True)))

    def operand_partition(self, mesh):
        parts = [p.operand_partition(mesh) for p in self.parts]
        return None if all(p is None for p in parts) else tuple(P() if p is None else p for p in parts)

    def init(self, spec):
        return self._each(lambda p, s: p.init(s), spec)

    def add(self, acc, batch, mask):
        return self._each(lambda p, a, x: p.add(a, x, mask), acc, batch)

    def finite_values(self, batch):
        """``nan_policy="omit"``: the parts (``Describe``'s refining passes) leave NaN out column by
        column, and an inf as a NaN (:meth:`Describe.finite_values`)."""
        return nonfinite_as_nan(batch)

    def merge(self, a, b):
        return self._each(lambda p, x, y: p.merge(x, y), a, b)

    def finalize(self, acc):
        return self._each(lambda p, a: p.finalize(a), acc)
