"""Per-column quantiles from a mergeable KLL sketch, or exactly in a few passes.

``Quantiles(qs=...)`` or ``Quantiles(num_buckets=...)`` (tf.Transform's ``quantiles``
boundaries: ``q = 1/B, ..., (B-1)/B``). One pass folds every column into a
:mod:`~sharded_scan.combiners.kll` sketch of about ``3k`` items; the answer for ``q`` is
read at the estimated ranks around ``q (n - 1)`` that ``method`` names, numpy's methods
(``"linear"``, the default of numpy and pandas, interpolates between the items at ranks
``floor`` and ``ceil`` of it; ``"lower"``, the default before, answers a value of the data);
``q = 0`` and ``q = 1`` are the exact minimum and maximum. While nothing has been compacted
(about ``k`` rows per shard or fewer) the answer is exactly
``np.quantile(x, qs, axis=0, method=method)``.

``Quantiles(exact=True)`` returns exactly that for any row count: the sketch brackets
every answer by keys, then each further pass counts the rows below and in ``2^bits``
bins of every bracket and narrows it to the bin holding the wanted rank, until the
bin is one value (:mod:`~sharded_scan.combiners.quantiles_exact`; :func:`sharded_scan.run`
runs the passes).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from sharded_scan.combiners import kll, wide
from sharded_scan.combiners.base import Combiner
from sharded_scan.combiners.datasketches import kll_state
from sharded_scan.combiners.keys import check_column_spec, fill, fold_if_any, key_dtype, kind_code, masked_columns
from sharded_scan.combiners.passes import MultiPass
from sharded_scan.combiners.quantiles_exact import exact_passes
from sharded_scan.combiners.quantiles_result import (
    QuantilesAcc,
    QuantilesResult,
    check_method,
    method_ranks,
    result_from_keys,
)
from sharded_scan.errors import UsageError

DEFAULT_K = 8192
MIN_K = 16
CONFIDENCE = 0.99


def check_qs(qs: Any, num_buckets: Any, who: str) -> tuple[float, ...]:
    """The quantiles asked for, from ``qs`` or ``num_buckets`` (exactly one), checked."""
    if (qs is None) == (num_buckets is None):
        raise UsageError(f"{who} needs exactly one of qs=[...] (values in [0, 1]) or num_buckets=B (B >= 1).")
    if num_buckets is not None:
        if isinstance(num_buckets, bool) or not isinstance(num_buckets, (int, np.integer)) or num_buckets < 1:
            raise UsageError(f"{who} num_buckets must be an integer >= 1, got num_buckets={num_buckets!r}.")
        return tuple(i / int(num_buckets) for i in range(1, int(num_buckets)))
    try:
        values = np.asarray(qs, np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise UsageError(f"{who} qs must be numbers in [0, 1], got qs={qs!r}.") from None
    if not np.all((values >= 0) & (values <= 1)):  # also refuses NaN
        raise UsageError(f"{who} qs must be numbers in [0, 1], got qs={qs!r}.")
    return tuple(float(v) for v in values)


def check_k(k: Any, who: str) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < MIN_K:
        raise UsageError(f"{who} k (the sketch size) must be an integer >= {MIN_K}, got k={k!r}.")


@dataclasses.dataclass(frozen=True)
class Quantiles(Combiner, MultiPass):
    """Quantiles of every column of rows X ``(n, d)`` (or of a vector), like ``np.quantile(X, qs, axis=0)``.

    Args:
      qs: the quantiles to return, each in ``[0, 1]``.
      num_buckets: instead of ``qs``: the ``num_buckets - 1`` boundaries that cut each
        column into ``num_buckets`` buckets of equal row counts (tf.Transform's
        ``quantiles``; ``num_buckets=1`` gives none).
      k: the sketch size, the accuracy knob: room for about ``4k`` keys per column
        (128 KiB at the default 8192), and a normalized rank error of a few ``1/k``: the
        result's ``rank_error`` bounds it; at the default the largest rank error over
        2001 quantiles of 10^7 rows was 1e-7 to 4.1e-4 (``python bench/sketches.py``).
      method: how an answer between two ranks is read, as ``np.quantile``'s: ``"linear"``
        (the default, numpy's and pandas'), ``"lower"`` (the default before: every answer a
        value of the data, as tf.Transform's boundaries), ``"higher"``, ``"nearest"``,
        ``"midpoint"``.
      exact: return exactly ``np.quantile(X, qs, axis=0, method=method)``, in 2 or 3
        passes over typical data (at most ``1 + ceil(32 / (bits - 1))``; 64 for 64-bit data), which
        :func:`sharded_scan.run` runs one after another.
      bits: with ``exact``, each pass after the first cuts every bracket into ``2^bits``
        bins (memory ``d * len(qs) * 2^bits`` counts).

    NaN and infinities: with ``nan_policy="propagate"`` a column holding NaN gives NaN
    (like ``np.quantile``) and infinities rank as the largest and smallest values; with
    ``"omit"`` rows holding NaN or Inf are skipped. ``-0.0`` and ``0.0`` count as one value.
    float64 and int64 values are ranked exactly, by 64-bit keys.
    """

    # qs are read on the host only: sketches that differ in qs alone compare equal and
    # share one compiled step (the fingerprint still names the qs).
    qs: Any = dataclasses.field(default=None, compare=False)
    num_buckets: int | None = None
    k: int = DEFAULT_K
    exact: bool = False
    bits: int = 10
    method: str = dataclasses.field(default="linear", compare=False)  # read on the host only, like qs

    def __post_init__(self):
        object.__setattr__(self, "qs", check_qs(self.qs, self.num_buckets, "Quantiles"))
        if self.num_buckets is not None:
            object.__setattr__(self, "num_buckets", None)  # qs now says it; one spelling per job
        check_k(self.k, "Quantiles")
        check_method(self.method, "Quantiles")
        if not isinstance(self.exact, (bool, np.bool_)):
            raise UsageError(f"Quantiles exact must be True or False, got exact={self.exact!r}.")
        bits = self.bits
        if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 2 <= bits <= 16:
            raise UsageError(f"Quantiles bits must be an integer in [2, 16], got bits={bits!r}.")

    def check_spec(self, spec):
        check_column_spec(spec, "Quantiles")

    def init(self, spec):
        shape = spec.shape
        d, keys = (shape[0] if shape else 1), key_dtype(spec.dtype)
        return QuantilesAcc(
            kll.empty(d, self.k, keys), wide.zeros(limbs=3), jnp.full(shape, fill(keys), keys),
            jnp.zeros(shape, keys), kind_code(spec.dtype),
        )

    def add(self, acc, batch, mask):
        return fold_if_any(mask, lambda acc: self._add(acc, batch, mask), acc)

    def _add(self, acc, batch, mask):
        keys = jnp.sort(masked_columns(batch, mask), axis=1)
        count = jnp.sum(mask, dtype=jnp.int32)
        sketch = kll.insert_sorted_rows(acc.sketch, keys, count, self.k)
        largest = jnp.take(keys, count - 1, axis=1)
        low = jnp.minimum(acc.low, keys[:, 0].reshape(acc.low.shape))
        high = jnp.maximum(acc.high, largest.reshape(acc.high.shape))
        return QuantilesAcc(sketch, wide.add_int32(acc.count, count), low, high, acc.kind)

    def merge(self, a, b):
        return QuantilesAcc(
            kll.merge(a.sketch, b.sketch, self.k), wide.add(a.count, b.count), jnp.minimum(a.low, b.low),
            jnp.maximum(a.high, b.high), a.kind,
        )

    def finalize(self, acc):
        return sketch_quantiles(acc, np.asarray(self.qs), self.method)._replace(sketch=kll_state(acc, self.k))

    @property
    def needs_passes(self) -> bool:
        return bool(self.exact)

    def passes(self):
        return exact_passes(self.qs, self.bits, self.method, dataclasses.replace(self, exact=False))


def sketch_picks(host: kll.HostSketch, qs: np.ndarray, rows, method: str):
    """The sketch's keys at the ranks ``method`` reads for ``qs`` over ``rows`` values (``(d, 1)`` or
    a number), and their weights: what :func:`~.quantiles_result.result_from_keys` takes."""
    low, high, weight = method_ranks(qs, rows, method)
    shape = (host.keys.shape[0], len(qs))
    low, high = np.broadcast_to(low, shape), np.broadcast_to(high, shape)
    return kll.keys_at(host, low), kll.keys_at(host, high), weight


def sketch_quantiles(acc: QuantilesAcc, qs: np.ndarray, method: str) -> QuantilesResult:
    """The sketch's answers for ``qs`` from a merged host accumulator."""
    host = kll.to_host(acc.sketch)
    total = host.cumulative[:, -1:] if host.keys.shape[1] else np.ones((host.keys.shape[0], 1))
    rows = int(wide.to_int(acc.count))
    bound = kll.rank_error_bound(float(acc.sketch.variance), rows, CONFIDENCE)
    return result_from_keys(acc, qs, sketch_picks(host, qs, total, method), rows, bound, passes=1)
