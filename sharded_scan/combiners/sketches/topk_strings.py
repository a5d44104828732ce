"""Results over string columns read as hash ids: TopK's values as the strings they stand for, and
DistinctCount's ``exact`` as far as the ids' hash allows.

The devices count a string column by its stable 64-bit :func:`~sharded_scan.hash_strings` ids; the
source that hashed them finds the strings of the few ids a result lists afterwards (``strings(column,
ids)``: it reads the column from its first row to its last, so every process gets the same strings and
two strings sharing an id are both found), and the result lists those strings as Python strings
(an object array: every code point, trailing NULs too), so a vocabulary is one call. Two strings
sharing an id (a hash collision: about ``2^-64`` a pair, ``2^-32`` for the int32 ids of a source's
``dtype='int32'``) are listed apart with their exact rows
where the result counts the column's rows (a ``TopK`` of the column itself); in a ``GroupBy`` or
``Weighted`` result, whose counts are per key or weights, one warning line says so and the column
is not ``certain``. A ``DistinctCount`` of a string column is ``exact`` only while the chance that
two of its distinct strings share an id is at most 1e-9 (:data:`EXACT_STRINGS` strings).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from sharded_scan.combiners.sketches.distinct import DistinctCountResult
from sharded_scan.combiners.sketches.topk import TopKResult
from sharded_scan.dtypes import STRING_ID_BITS
from sharded_scan.errors import UsageError

COLLISION_CHANCE = 1e-9  # the most a string column's `exact` distinct count may be wrong by a shared id


def with_strings(result: Any, columns: Sequence[str], source: Any) -> Any:
    """``result``, where it describes ``source``'s string ``columns``: a :class:`TopKResult` with its
    ``values`` as their strings (an object array of Python strings, ``(d, k)`` or ``(k,)`` like the ids;
    ``""`` where a column lists fewer values, as ``counts`` 0 says); a :class:`DistinctCountResult` with
    ``exact`` False past :data:`EXACT_STRINGS` (``relative_error``: the expected share of strings lost
    to shared ids, ``count / 2^65``).

    Args:
      result: what a combiner's ``finalize`` returned.
      columns: the names of the columns the result's columns count, in order.
      source: the data: its ``string_columns``, ``strings(column, ids) -> {id: {string: rows}}`` and
        ``counts_rows`` (default True: the result counts the column's rows; False for a part of a row,
        which a ``GroupBy`` or ``Weighted`` result counts per key or weight).
    """
    if not columns or not set(columns) <= set(source.string_columns):
        return result
    if isinstance(result, DistinctCountResult):
        return _distinct(result, id_bits(source))
    if not isinstance(result, TopKResult) or np.asarray(result.values).dtype.kind not in "iu":
        return result
    one = np.ndim(result.values) == 1
    values, counts, errors = (np.array(np.atleast_2d(x)) for x in (result.values, result.counts, result.errors))
    bound, certain = np.array(np.atleast_1d(result.bound)), np.array(np.atleast_1d(result.certain))
    out = np.full(values.shape, "", dtype=object)
    rows = getattr(source, "counts_rows", True)
    for j, column in enumerate(columns):
        listed = [int(i) for i in values[j][counts[j] > 0]]  # every value counted has count >= 1
        found = source.strings(column, listed)
        missing = [i for i in listed if i not in found]
        if missing:
            raise UsageError(f"string column {column!r} no longer holds the value of id {missing[0]} that the run "
                             "counted: the data changed after it was read; run the job again.")
        entries = []  # (string, count, error): the listed ids, a shared one as its strings
        for i, count, error in zip(listed, counts[j].tolist(), errors[j].tolist(), strict=False):
            strings = sorted(found[i].items(), key=lambda item: -item[1])
            if len(strings) == 1:
                entries.append((strings[0][0], count, error))
            elif rows:  # the rows of each: exact, from the whole column
                entries.extend((s, type(count)(n), type(error)(0)) for s, n in strings)
            else:
                names = ", ".join(repr(s) for s, _ in strings)
                warnings.warn(f"the strings {names} of column {column!r} share the id {i} (a hash collision): "
                              f"the count listed for {strings[0][0]!r} is theirs together, and the column is not "
                              "certain.", stacklevel=2)
                entries.append((strings[0][0], count, error))
                certain[j] = False
        entries.sort(key=lambda e: -e[1])  # stable: ties keep the ids' order
        k = values.shape[1]
        for _, count, error in entries[k:]:  # split strings that no longer fit: unlisted, so under the bound
            bound[j] = max(bound[j], count + error)
        top = entries[:k]
        out[j, : len(top)] = [e[0] for e in top]
        counts[j, : len(top)], errors[j, : len(top)] = [e[1] for e in top], [e[2] for e in top]
        if len(entries) > len(listed):
            certain[j] = not top or counts[j, len(top) - 1] >= bound[j]
    if one:
        return result._replace(values=out[0], counts=counts[0], errors=errors[0], bound=bound[0], certain=certain[0])
    return result._replace(values=out, counts=counts, errors=errors, bound=bound, certain=certain)


def exact_strings(bits: int = STRING_ID_BITS) -> int:
    """The most distinct strings whose ``bits``-bit ids all differ but for a chance of at most
    :data:`COLLISION_CHANCE`: ``n (n - 1) / 2`` pairs, each sharing an id with probability ``2^-bits``."""
    return math.floor((1 + math.sqrt(1 + 8 * COLLISION_CHANCE * 2.0**bits)) / 2)


EXACT_STRINGS = exact_strings()  # 192,077 of 64-bit ids (3 of the 32-bit ids of dtype='int32')


def id_bits(source: Any) -> int:
    """The bits of ``source``'s string ids: 64, or 32 where it read them as int32 (``dtype='int32'``)."""
    dtypes = {np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(source.spec)}
    return 32 if dtypes == {4} else STRING_ID_BITS


def _distinct(result: DistinctCountResult, bits: int) -> DistinctCountResult:
    """``result`` with ``exact`` only where at most :func:`exact_strings` strings were counted."""
    count = np.asarray(result.count)
    past = np.asarray(result.exact) & (count > exact_strings(bits))
    if not past.any():
        return result
    return result._replace(exact=np.asarray(result.exact) & ~past,
                           relative_error=np.where(past, count / 2.0 ** (bits + 1), result.relative_error))


class StringsReadOnce:
    """``source``, whose strings of every id a stacked (``GroupBy``) ``TopKResult`` lists are read once,
    on the first ask for each column: each key's result then asks it, not the data."""

    def __init__(self, source: Any, stacked: Any):
        self._source, self._found = source, {}
        values, counts = np.asarray(stacked.values), np.asarray(stacked.counts)
        self._ids = np.unique(values[counts > 0]).tolist()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._source, name)

    def strings(self, column: str, ids: Sequence[int]) -> dict[int, dict[str, int]]:
        if column not in self._found:
            self._found[column] = self._source.strings(column, self._ids)
        found = self._found[column]
        return {i: found[i] for i in ids if i in found}


def read_once(result: Any, source: Any) -> Any:
    """``source``, or :class:`StringsReadOnce` of it for a stacked ``TopKResult`` of string ids."""
    if isinstance(result, TopKResult) and np.asarray(result.values).dtype.kind in "iu" and source.string_columns:
        return StringsReadOnce(source, result)
    return source
