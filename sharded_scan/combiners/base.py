"""The Combiner protocol: how a reduction folds rows, merges partials and finishes.

A combiner describes one reduction in four pure functions:

- ``init(spec) -> acc``: the identity accumulator for one shard. ``spec`` is a pytree,
  shaped like the data, of ``jax.ShapeDtypeStruct`` giving the shape and dtype of ONE
  row of each leaf (no row dimension).
- ``add(acc, batch, mask) -> acc``: fold a micro-batch in. ``batch`` is a pytree of
  arrays with a leading row dimension ``mb``; ``mask`` is a ``(mb,)`` bool array and
  rows where it is False are padding that must not count.
- ``merge(a, b) -> acc``: combine two partial accumulators. Associative, with
  ``init(spec)`` as its identity.
- ``finalize(acc) -> result``: turn the merged accumulator, given as host numpy
  arrays, into the result (numpy, or a NamedTuple of numpy arrays).

``init``, ``add`` and ``merge`` are traced by JAX and run on devices; ``finalize`` runs
on the host in numpy (float64 where it helps accuracy).

A combiner whose ``merge`` is leafwise addition sets ``additive = True`` (or derives
from :class:`AdditiveCombiner`); the engine then merges its partials with one ``psum``.
One whose ``merge`` is another leafwise order-free reduction (a minimum, a maximum, an exact
integer sum) names it per leaf in :meth:`Combiner.merge_collectives`: one collective a leaf.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from sharded_scan.dtypes import check_numeric
from sharded_scan.errors import UsageError

PyTree = Any


# A job whose shards each fold fewer micro-batches than this is short: a combiner may compile less for its steps
# (the KLL sketch leaves out a window size, whose compile its faster moves pay back only over more micro-batches).
FEW_MICROBATCHES = 64
# The step being traced: 0 a job's that is not short, 1 where each shard folds one micro-batch over the job, 2 a few.
_few_microbatches = contextvars.ContextVar("sharded_scan_few_microbatches", default=0)


def folds_few_microbatches() -> bool:
    """Whether the step being traced is a short job's (:data:`FEW_MICROBATCHES`; ``compiled.compile_step`` says)."""
    return _few_microbatches.get() > 0


def folds_one_microbatch() -> bool:
    """Whether each shard of the job whose step is being traced folds one micro-batch over the job (a small
    job's layout: ``layout.resolve_chunking``)."""
    return _few_microbatches.get() == 1


@contextlib.contextmanager
def folding_per_key():
    """While tracing a keyed add (``GroupBy``'s): a shard's micro-batch folds as an insertion a key, many and
    small, so :func:`folds_one_microbatch` does not hold in it (:func:`folds_few_microbatches` still does)."""
    with folding_few_microbatches(2 if folds_one_microbatch() else _few_microbatches.get()):
        yield


def reads_few_microbatches(combiner: Any) -> bool:
    """Whether ``combiner``, or a combiner in its dataclass fields (a wrapper's inner one, at any depth), has
    ``compiles_less_when_short``: only then is a short job's step another program (else one program serves both)."""
    if getattr(combiner, "compiles_less_when_short", False):
        return True
    if not dataclasses.is_dataclass(combiner):
        return False
    values = [getattr(combiner, f.name) for f in dataclasses.fields(combiner)]
    values = [v for value in values for v in (value if isinstance(value, (tuple, list)) else (value,))]
    return any(isinstance(v, Combiner) and reads_few_microbatches(v) for v in values)


#: Shards from which a job's pair merge, run ``shards - 1`` times, is worth more compile (:func:`merges_many_shards`).
MANY_SHARDS = 8
_many_shards = contextvars.ContextVar("sharded_scan_many_shards", default=False)


def merges_many_shards() -> bool:
    """Whether the pair merge being traced folds :data:`MANY_SHARDS` or more shards, one pair at a time: a combiner
    may spend more compile on a merge that runs that often (:func:`merging_many_shards`). A flag, not the count, so
    that one program serves jobs of every shard count on each side of it."""
    return _many_shards.get()


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar, value):
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def merging_many_shards(many: bool):
    """While tracing a pair merge: :func:`merges_many_shards` is ``many`` (a context manager)."""
    return _setting(_many_shards, bool(many))


def folding_few_microbatches(few: int):
    """While tracing a step: ``few`` (``Program.short``: 0 not a short job, 1 one micro-batch a shard, 2 a few)
    is what :func:`folds_few_microbatches` and :func:`folds_one_microbatch` read (a context manager)."""
    return _setting(_few_microbatches, int(few))


_row_numbers = contextvars.ContextVar("sharded_scan_row_numbers", default=None)


def row_number(i: int) -> int:
    """Row ``i`` of the rows a ``check_rows`` is given as its row of the data: a ``nan_policy`` that skips rows
    checks the others only (:func:`checking_rows`)."""
    numbers = _row_numbers.get()
    return int(i) if numbers is None else int(numbers[i])


def checking_rows(numbers):
    """While a ``check_rows`` runs on some rows of the data: ``numbers``, their rows of it (None: all, in order)."""
    return _setting(_row_numbers, numbers)


class Combiner(abc.ABC):
    """Base class for reductions run by :func:`sharded_scan.run`."""

    #: True when ``merge`` is leafwise addition (enables the ``psum`` fast path).
    additive: bool = False
    #: True when the combiner counts values by key (TopK, DistinctCount), so string columns read
    #: as :func:`~sharded_scan.hash_strings` ids may feed it; the others refuse them in one line.
    takes_string_ids: bool = False
    #: Where in a row the data is that the result describes (indices into the row's pytree; its
    #: columns name the result's): ``()`` the whole row; ``(1,)`` for ``(keys, data)`` or ``(w, data)``.
    data_part: tuple[int, ...] = ()
    #: True when ``add`` is slow to compile and cheap to mask (LinearRegression's and PCA's re-whitening
    #: fold): each step compiles one scan, not a second, constant-mask copy for steps of real rows only.
    one_scan_per_step: bool = False
    #: True when ``add`` compiles less in a short job's step (:func:`folds_few_microbatches`; the KLL sketch's).
    compiles_less_when_short: bool = False
    #: The values (rows x values a row) a job's default micro-batch holds at least, where ``add`` pays a fixed cost
    #: a micro-batch that more rows amortize (TopK's choice of ``capacity`` of ``capacity + m``); 0: the 4 MiB
    #: default alone (:func:`~sharded_scan.layout.resolve_chunking`). Chosen from the job, never from timing.
    microbatch_values: int = 0
    #: True when ``finalize`` of an accumulator with a leading key axis on every leaf gives each key's
    #: result along that axis, also for keys of no rows (``Sum``): ``GroupBy`` then finalizes every key
    #: in one call instead of one a key.
    finalizes_stacked: bool = False

    @abc.abstractmethod
    def init(self, spec: PyTree) -> PyTree:
        """Returns the identity accumulator for data whose rows have ``spec``."""

    @abc.abstractmethod
    def add(self, acc: PyTree, batch: PyTree, mask: jax.Array) -> PyTree:
        """Folds one micro-batch into ``acc``; rows with ``mask`` False are ignored."""

    @abc.abstractmethod
    def merge(self, a: PyTree, b: PyTree) -> PyTree:
        """Combines two partial accumulators (associative; ``init`` is the identity)."""

    @abc.abstractmethod
    def finalize(self, acc: PyTree) -> Any:
        """Turns the merged accumulator (host numpy arrays) into the result."""

    def for_mesh(self, mesh: Mesh) -> Combiner:
        """Returns the combiner to run on ``mesh`` (by default ``self``).

        A combiner whose accumulator can be split over the mesh's non-``data`` axes
        returns a copy configured for them; the engine calls this before ``init``.
        """
        del mesh
        return self

    def partition(self, mesh: Mesh) -> PyTree | None:
        """How the accumulator's own axes are split over the mesh's non-``data`` axes.

        Returns None (the default: every leaf replicated over the non-``data`` axes)
        or a pytree prefix of the accumulator of ``PartitionSpec``s, one entry per leaf
        axis, e.g. ``P(None, 'model')`` for a (d, d) matrix split by columns. ``add``
        then sees only its own block and may find it with
        ``jax.lax.axis_index('model')``; the merge sums over ``data`` only and the
        result stays split until it is gathered for ``finalize``.
        """
        del mesh
        return None

    def merge_collectives(self) -> PyTree | None:
        """How ``merge`` is one collective a leaf, or None (the default: it is not, or ``additive``).

        A pytree prefix of the accumulator naming, per part, the reduction ``merge`` does on it
        leafwise: ``"min"``, ``"max"``, ``"sum_exact"`` (integers, or a :class:`~.wide.Wide`: summed,
        then normalised; exact in any order) or ``"sum"`` (floats: rounds by order). The engine then
        merges the partials by one ``pmin`` / ``pmax`` / ``psum`` a leaf over ``data`` (O(state) a
        device, no all-gather; a part split over ``model`` stays split); under ``logical_shards`` only
        when every part is exact (no ``"sum"``), else by the fixed tree as before.
        """
        return None

    def operands(self, spec: PyTree) -> PyTree:
        """Runtime values the programs take as arguments instead of compiling them in.

        A combiner whose parameters are data (a gradient's ``params``, a histogram's
        edges) returns them here as host arrays, and defines ``__eq__`` / ``__hash__``
        on everything else: a new value then reuses the compiled programs. Inside the
        programs the engine calls :meth:`bind` with them. The default: None (none).
        """
        del spec
        return None

    def bind(self, operands: PyTree) -> Combiner:
        """This combiner computing with ``operands`` (traced values shaped like :meth:`operands`)."""
        del operands
        return self

    def operand_partition(self, mesh: Mesh) -> PyTree | None:
        """How :meth:`operands` split over the mesh's non-``data`` axes, as :meth:`partition` splits the
        accumulator.

        Returns None (the default: every operand whole on every device) or a pytree prefix of the
        operands of ``PartitionSpec``s (their axes divisible by the mesh axes they name: pad them in
        :meth:`operands`). Inside the step's and the merges' ``shard_map`` :meth:`bind` then receives
        this device's block; outside one (a merge of two states on one device, a checkpoint's
        conversion) the whole operands, as :meth:`operands` made them.
        """
        del mesh
        return None

    def convert(self, acc: PyTree, source: Combiner) -> PyTree:
        """``acc`` of ``source`` (this job resolved for another mesh) as this combiner's accumulator.

        Called on resume when the checkpoint was written on a mesh whose non-``data``
        axes resolved the job differently (:meth:`for_mesh`). The default handles
        combiners that do not depend on the mesh.
        """
        if source == self:
            return acc
        raise UsageError(
            f"{type(self).__name__} cannot take an accumulator written for a mesh with other axes; "
            "resume on a mesh with the axes of the run that wrote the checkpoint."
        )

    def check_spec(self, spec: PyTree) -> None:
        """Raises :class:`UsageError` when the combiner cannot take data of ``spec``.

        Called once before any compute. The default accepts anything numeric.
        """
        for leaf in jax.tree.leaves(spec):
            check_numeric(leaf.dtype, type(self).__name__)

    def check_rows(self, rows: PyTree) -> None:
        """Raises :class:`UsageError` when rows held in memory hold values this combiner refuses.

        Called once before any compute with the whole data as host numpy (a pytree shaped like
        ``spec``) when it is in memory; data read from files meets the same checks in the run.
        The default accepts anything.
        """
        del rows

    def add_keyed(self, acc: PyTree, batch: PyTree, mask: jax.Array, keys: jax.Array, num_keys: int) -> PyTree:
        """Folds a micro-batch into ``num_keys`` accumulators, row ``i`` into ``acc[keys[i]]``.

        ``acc`` is this combiner's accumulator with a leading axis of ``num_keys`` on every
        leaf; ``keys`` is int32 ``(rows,)``, in ``[0, num_keys)`` where ``mask`` is True
        (padding rows may hold anything). The default is right for any combiner and does
        ``num_keys`` adds per micro-batch; built-ins override it with segment reductions.
        """

        def fold(args):
            one, key = args
            return self.add(one, batch, mask & (keys == key))

        # One key after another: batched, a lax.cond in add (the sketches') fails under shard_map.
        return jax.lax.map(fold, (acc, jnp.arange(num_keys, dtype=jnp.int32)))

    def weighted(self) -> Combiner:
        """The combiner of rows ``(w, data)``: ``data`` weighted by float ``w`` (``(rows,)``).

        :class:`~sharded_scan.combiners.wrappers.weighted.Weighted` runs it and hands it rows with
        ``mask`` True only where ``w`` is finite and above 0 (a zero weight is an omitted row).
        """
        raise UsageError(f"{type(self).__name__} takes no weights; drop Weighted(...), or use a combiner that does.")

    def fingerprint(self) -> dict[str, Any]:
        """Returns what identifies this reduction: its class and parameters.

        Two runs may share a checkpoint only when their fingerprints are equal. The
        default uses the dataclass fields (or ``vars``) rendered with ``repr``.
        """
        if dataclasses.is_dataclass(self):
            params = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        else:
            params = dict(vars(self))
        return {"combiner": type(self).__name__, **{k: repr(v) for k, v in params.items()}}

    def add_omitting(self, acc: PyTree, batch: PyTree, mask: jax.Array, keep: jax.Array) -> PyTree:
        """Folds the rows where ``keep`` (``mask`` less the rows ``nan_policy="omit"`` skips).

        The default is ``add(acc, batch, keep)``; a combiner that reports what was skipped
        (``Moments``' ``nan_count``) reads ``mask``, the real rows, too.
        """
        del mask
        return self.add(acc, batch, keep)

    def add_keyed_omitting(self, acc: PyTree, batch: PyTree, mask: jax.Array, keep: jax.Array, keys: jax.Array,
                           num_keys: int) -> PyTree:
        """:meth:`add_omitting` per key, as :meth:`add_keyed` is :meth:`add` per key (for ``GroupBy``)."""
        del mask
        return self.add_keyed(acc, batch, keep, keys, num_keys)

    def omitting_values(self) -> Combiner:
        """The combiner ``nan_policy="omit"`` runs: one that skips each NaN or inf where it stands
        (:meth:`add_finite`). The default is ``self``, whose :meth:`add_finite` skips whole rows: right for
        the statistics of whole rows (``LinearRegression``, ``PCA``, ``Gram``), as statsmodels'
        ``missing="drop"``. ``Moments`` returns its per-column form, ``Covariance`` its pairwise one."""
        return self

    def finite_values(self, batch: PyTree) -> PyTree | None:
        """The micro-batch this combiner folds under ``nan_policy="omit"`` so that each NaN or inf is skipped
        where it stands, or None (the default: every row holding one is skipped). A combiner that already
        leaves NaN out column by column returns ``batch`` with each inf made NaN (``Describe``, ``Quantiles``:
        :func:`nonfinite_as_nan`), ``Sum`` with each made 0."""
        del batch
        return None

    def add_finite(self, acc: PyTree, batch: PyTree, mask: jax.Array, keep: jax.Array) -> PyTree:
        """Folds the rows ``keep`` (of the real rows ``mask``) less their NaN and inf values (``nan_policy="omit"``).

        The default: :meth:`finite_values`' batch, else every row holding one skipped (:meth:`add_omitting`
        of the finite rows, right for the statistics of whole rows). ``FiniteMoments``, ``TopK``, ``DistinctCount`` and
        the pairwise ``Covariance`` override it.
        """
        values = self.finite_values(batch)
        if values is None:
            return self.add_omitting(acc, batch, mask, keep & finite_rows(batch))
        return self.add_omitting(acc, values, mask, keep)

    def add_keyed_finite(self, acc: PyTree, batch: PyTree, mask: jax.Array, keep: jax.Array, keys: jax.Array,
                         num_keys: int) -> PyTree:
        """:meth:`add_finite` per key (for ``GroupBy``)."""
        values = self.finite_values(batch)
        if values is None:
            return self.add_keyed_omitting(acc, batch, mask, keep & finite_rows(batch), keys, num_keys)
        return self.add_keyed_omitting(acc, values, mask, keep, keys, num_keys)

    def finite_keep(self, batch: PyTree, keep: jax.Array) -> jax.Array:
        """The rows of ``keep`` that :meth:`add_finite` folds at all (``GroupBy`` counts them per key): those
        whose every value is finite, or all of them where the values are skipped where they stand."""
        return keep & finite_rows(batch) if self.finite_values(batch) is None else keep


class AdditiveCombiner(Combiner):
    """A combiner whose merge is leafwise addition: partials are combined by ``psum``."""

    additive = True

    def merge(self, a: PyTree, b: PyTree) -> PyTree:
        return jax.tree.map(jnp.add, a, b)


def finite_rows(batch: PyTree, xp: Any = jnp) -> jax.Array:
    """Per row of ``batch`` (a pytree of ``(rows, ...)`` arrays): whether its every float value is finite
    (``xp=np``: of host arrays, on the host, in their own dtypes)."""
    leaves = jax.tree.leaves(batch)
    finite = xp.ones((leaves[0].shape[0],), bool)
    for leaf in leaves:
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            finite &= xp.all(xp.isfinite(leaf).reshape(leaf.shape[0], -1), axis=1)
    return finite


def nonfinite_as(batch: PyTree, value: float) -> PyTree:
    """``batch`` with each NaN or inf float value ``value``: what a combiner that skips values where they stand
    folds under ``nan_policy="omit"`` (NaN: ``Describe``, ``Quantiles``, which leave NaN out column by
    column, so that an inf is skipped too; 0: ``Sum``, to which it adds nothing)."""
    def one(x):
        return jnp.where(jnp.isfinite(x), x, value) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(one, batch)


def nonfinite_as_nan(batch: PyTree) -> PyTree:
    """:func:`nonfinite_as` NaN."""
    return nonfinite_as(batch, jnp.nan)


def masked(x: jax.Array, mask: jax.Array, fill: Any = 0) -> jax.Array:
    """Replaces the rows of ``x`` where ``mask`` is False by ``fill``."""
    mask = mask.reshape(mask.shape + (1,) * (x.ndim - 1))
    return jnp.where(mask, x, jnp.asarray(fill, x.dtype))


def row_count(mask: jax.Array) -> jax.Array:
    """The number of real (unmasked) rows, as int32."""
    return jnp.sum(mask, dtype=jnp.int32)


def rows_spec(spec: PyTree, n: int) -> PyTree:
    """The spec of a batch of ``n`` rows of ``spec`` (for ``jax.eval_shape`` checks)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct((n, *s.shape), s.dtype), spec)


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
