"""TopK's values as the strings they stand for, when its columns were strings read as hash ids.

The devices count a string column by its stable :func:`~sharded_scan.hash_strings` ids; the
source that hashed them finds the few strings a result lists afterwards (``strings(column,
ids)``: it reads the column from its first row until each is found, so every process gets
the same strings), and the result lists those strings, so a vocabulary is one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sharded_scan.combiners.topk import TopKResult
from sharded_scan.errors import UsageError


def with_strings(result: Any, columns: Sequence[str], source: Any) -> Any:
    """``result``; a :class:`TopKResult` of ``source``'s string ``columns`` with its ``values`` as
    their strings (numpy unicode, ``(d, k)`` or ``(k,)`` like the ids; ``""`` where a column lists
    fewer values, as ``counts`` 0 says).

    Args:
      result: what a combiner's ``finalize`` returned.
      columns: the names of the columns the result's columns count, in order.
      source: the data: its ``string_columns`` and ``strings(column, ids) -> {id: string}``.
    """
    if not isinstance(result, TopKResult) or not columns or not set(columns) <= set(source.string_columns):
        return result
    ids, counts = np.atleast_2d(result.values), np.atleast_2d(result.counts)
    out = np.full(ids.shape, "", dtype=object)
    for j, column in enumerate(columns):
        listed = [int(i) for i in ids[j][counts[j] > 0]]  # every value counted has count >= 1
        found = source.strings(column, listed)
        missing = [i for i in listed if i not in found]
        if missing:
            raise UsageError(f"string column {column!r} no longer holds the value of id {missing[0]} that the run "
                             "counted: the data changed after it was read; run the job again.")
        out[j, : len(listed)] = [found[i] for i in listed]
    out = out.astype(str)
    return result._replace(values=out[0] if np.ndim(result.values) == 1 else out)
