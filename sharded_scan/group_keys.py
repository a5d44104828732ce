"""The keys of a ``GroupBy`` by value: found before compute, read as dense slots.

A ``GroupBy`` without ``num_keys`` groups rows by their keys' values (strings, integers of any width,
bools, categoricals). Before anything compiles, :func:`grouped_source` finds the distinct keys: for keys in
memory by ``pandas.factorize`` (sorted, missing keys dropped), for keys a source reads (a Parquet or CSV
column) by reading that column once, chunk by chunk, bounded by ``max_keys`` (more is one line as soon as
seen): a file's column as Arrow chunks, a string column's ids and strings together, its nulls missing keys
(their rows dropped, as pandas' ``groupby(dropna=True)``; the result's ``rows`` count the rows kept); another
source's string ids turned back into strings by ``Source.strings``. The keys, sorted as pandas sorts them (a
categorical's, and a file's dictionary column's, in their categories' order), number the slots; each row's
key reaches the devices as its slot (int32): the same dense programs as ``num_keys`` = the number of keys.
Every process reads the whole key column, so every process finds the same keys and slots; a resumed run finds them
again from the same (stamped) files, and the fingerprint names them (``GroupBy.fingerprint``): checkpoints, resumes
and multi-host runs stay exact.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from sharded_scan.combiners.results import pandas
from sharded_scan.combiners.wrappers.grouped import MISSING, GroupBy, too_many_keys
from sharded_scan.dtypes import string_ids_of_utf8
from sharded_scan.errors import UsageError
from sharded_scan.sources import Source, as_source
from sharded_scan.sources.compose import TreeSource
from sharded_scan.sources.tabular import _dictionary, _utf8_buffers

CHUNK_ROWS = 1 << 20  # rows of the key column read at a time when finding a source's keys


def grouped_source(combiner: Any, data: Any) -> tuple[Any, Source]:
    """``(combiner, as_source(data))``; for a ``GroupBy`` of keys by value (or ``by=`` a column), the data
    as ``(slots, data)`` and the GroupBy bound to its keys (:meth:`GroupBy.with_keys`).

    Raises:
      UsageError: ``by`` names no column of the data, keys not one a row, more distinct keys than
        ``max_keys``, two strings of one 64-bit id, or no key at all.
    """
    if not isinstance(combiner, GroupBy):
        return combiner, as_source(data)
    if combiner.by is not None:
        data = split_by(data, combiner.by)
    if not combiner.by_value:
        check_dense(data, combiner.num_keys)
    if not combiner.by_value or combiner.key_values is not None:
        return combiner, as_source(data)
    keys, rest = key_part(data)
    if isinstance(keys, Source):
        if not keys.rereadable:
            raise UsageError("GroupBy without num_keys reads the keys once before the run to find them, and this "
                             "source can be read only once; pass num_keys=N with keys 0..N-1, or a source that reads "
                             "again (an IteratorSource with get_state/set_state).")
        name = keys.column_names if isinstance(keys.column_names, str) else None
        values, found, slots = source_keys(keys, combiner.bound)
        keys = KeySlots(keys, found, slots, len(values))
    else:
        name = combiner.by or _name(keys)
        keys, values = memory_keys(keys, combiner.bound)
    if not len(values):
        raise UsageError("every GroupBy key is missing (NaN or None), and such rows are dropped (as pandas' "
                         "groupby(dropna=True)): there is no group to reduce; check the keys.")
    return combiner.with_keys(values, name), as_source((keys, rest))


def check_dense(data: Any, num_keys: int) -> None:
    """One line when ``GroupBy(num_keys=N)``'s keys in memory are not integers (strings, floats...)."""
    keys = data[0] if isinstance(data, (tuple, list)) and len(data) == 2 else None
    kind = getattr(getattr(keys, "dtype", None), "kind", None)
    if kind is not None and kind not in "iu" and not isinstance(keys, Source):
        raise UsageError(f"GroupBy(num_keys={num_keys}) keys must be integers 0..{num_keys - 1}, got "
                         f"{keys.dtype}; leave num_keys out to group by the keys' values (any type; max_keys= "
                         "bounds them).")


def _name(keys: Any) -> str | None:
    name = getattr(keys, "name", None)
    return None if name is None or callable(name) else str(name)


def key_part(data: Any) -> tuple[Any, Any]:
    """The keys and the rest of rows ``(keys, data)`` (a pair, or a TreeSource of a pair)."""
    if isinstance(data, TreeSource):
        data = data.parts
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return data[0], data[1]
    raise UsageError("GroupBy runs on data (keys, data): a pair whose first item holds one key a row, or on a "
                     "DataFrame or Parquet/CSV source with by= naming the keys' column.")


def split_by(data: Any, by: str) -> tuple[Any, Any]:
    """A DataFrame or tabular source as ``(its column by, its other columns)``."""
    if hasattr(data, "columns") and hasattr(data, "drop") and type(data).__module__.split(".")[0] in (
            "pandas", "polars"):
        names = [str(c) for c in data.columns]
        if by not in names:
            raise UsageError(f"GroupBy by={by!r} is not a column of the DataFrame (its columns: "
                             f"{', '.join(map(repr, names[:8]))}{', ...' if len(names) > 8 else ''}).")
        column = list(data.columns)[names.index(by)]
        rest = data.drop(columns=[column]) if hasattr(data, "iloc") else data.drop(column)  # pandas, polars
        return data[column], rest
    if hasattr(data, "grouped_by"):
        return data.grouped_by(by).parts
    raise UsageError(f"GroupBy by={by!r} names a column of a pandas/polars DataFrame or a ParquetSource/CsvSource, "
                     f"and the data is a {type(data).__name__}; pass the rows as (keys, data) instead.")


def _object_values(values: Any) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = list(values)
    return out


def memory_keys(keys: Any, max_keys: int) -> tuple[np.ndarray, np.ndarray]:
    """Keys in memory (numpy, pandas, Arrow, polars, a list) as int32 slots (``MISSING``: NaN/None) and the
    sorted distinct keys (``pandas.factorize(sort=True)``: pandas' own order, a categorical's its categories')."""
    pd = pandas()
    if type(keys).__module__.split(".")[0] in ("pyarrow", "polars"):
        keys = keys.to_pandas()
    elif isinstance(keys, (list, tuple)):
        keys = _object_values(keys)
    ndim = getattr(keys, "ndim", 1)
    if ndim != 1:
        raise UsageError(f"GroupBy keys must be one key a row (shape (rows,)), got rows of "
                         f"{tuple(getattr(keys, 'shape', ())[1:])}; pass a 1-D array or a Series of keys.")
    try:
        codes, uniques = pd.factorize(keys, sort=True)
    except TypeError as e:
        raise UsageError(f"GroupBy keys cannot be sorted or hashed ({e}); pass keys of one type (strings, "
                         "integers, bools or a categorical).") from None
    if len(uniques) > max_keys:
        raise too_many_keys(len(uniques), max_keys)
    values = np.asarray(uniques)
    if values.dtype.kind in "OUS" or isinstance(getattr(uniques, "dtype", None), pd.StringDtype):
        values = _object_values([str(v) if isinstance(v, str) else v for v in values.tolist()])
    return np.asarray(codes, np.int32), values


def source_keys(keys: Source, max_keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct keys of a source's key column, read once in chunks of ``CHUNK_ROWS`` (more than
    ``max_keys`` is one line as soon as seen): the keys sorted (``values``), the distinct values as read
    (``found``, sorted: a string column's ids) and each one's slot."""
    spec = keys.spec
    if not isinstance(spec, jax.ShapeDtypeStruct) or spec.shape != ():
        raise UsageError("GroupBy keys must be one key a row; name one column for the keys.")
    if hasattr(keys, "key_chunks"):  # a column of a file, read once (a string column with its strings)
        return _column_keys(keys, max_keys)
    found = np.zeros(0, np.dtype(spec.dtype))
    for start in range(0, keys.num_rows, CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, keys.num_rows)
        chunk = np.unique(np.asarray(keys.read(start, stop)))
        found = np.union1d(found, chunk[~np.isnan(chunk)] if chunk.dtype.kind == "f" else chunk)
        if len(found) > max_keys:
            raise too_many_keys(len(found), max_keys, f"at least (by row {stop} of {keys.num_rows}) ")
    if not keys.string_columns:
        return found, found, np.arange(len(found), dtype=np.int32)
    column = keys.string_columns[0]
    return _sorted_strings(column, found, keys.strings(column, found.tolist()))


def _sorted_strings(column: str, found: np.ndarray, strings: dict[int, Any],
                    categories: dict[str, int] | None = None) -> tuple[np.ndarray, ...]:
    """The strings of a key column's ``found`` ids (``strings``: id -> the strings of that id) sorted as pandas
    sorts them (as Python does; a categorical's in its ``categories``' order: string -> place), ``found`` and each
    id's slot; one line for two strings of one id."""
    shared = next((i for i in found.tolist() if len(strings.get(i, ())) != 1), None)
    if shared is not None:
        raise UsageError(f"the GroupBy key column {column!r} holds the strings {sorted(strings.get(shared, {}))!r}, "
                         f"which share the 64-bit id {shared} (about 1 in 2^64 per pair; an int32 dtype keeps 32 "
                         "bits): they cannot be told apart as keys; rename one.")
    text = [next(iter(strings[i])) for i in found.tolist()]
    order = sorted(range(len(text)), key=text.__getitem__ if categories is None else  # pandas sorts strings as
                   lambda i: categories[text[i]])  # Python does, a categorical's keys in their categories' order
    slots = np.empty(len(text), np.int32)
    slots[order] = np.arange(len(text), dtype=np.int32)
    return _object_values([text[i] for i in order]), found, slots


def _column_keys(keys: Source, max_keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`source_keys` of a Parquet or CSV key column, read once as Arrow chunks (``key_chunks``): a
    string column's ids and strings together. Null keys are missing (their rows dropped, as pandas'
    ``groupby(dropna=True)``): the column reads them as a value no key has (``read_missing_as``)."""
    dtype = np.dtype(keys.spec.dtype)
    found, strings, rows, missing = np.zeros(0, dtype), {}, 0, 0
    categories: dict[str, int] | None = None  # a dictionary column's values, in the order pandas reads them
    for chunk in keys.key_chunks():
        if hasattr(chunk, "dictionary"):  # as pandas' to_pandas unifies them: the first, then values new in others
            categories = {} if categories is None else categories
            for value in chunk.dictionary.to_pylist():
                categories.setdefault(value, len(categories))
        for lo in range(0, len(chunk), CHUNK_ROWS):
            part = chunk.slice(lo, CHUNK_ROWS)
            missing += part.null_count
            present = part.drop_null() if part.null_count else part
            if keys.string_columns:
                dictionary, indices = _dictionary(present)
                used = np.unique(indices)  # a dictionary column's dictionary may hold values no row has
                ids = string_ids_of_utf8(*_utf8_buffers(dictionary)).astype(dtype)[used]
                for i, at in zip(ids.tolist(), used.tolist(), strict=True):
                    strings.setdefault(i, set()).add(dictionary[at].as_py())
            else:
                ids = np.unique(np.asarray(present.to_numpy(zero_copy_only=False), dtype))
                ids = ids[~np.isnan(ids)] if dtype.kind == "f" else ids
            found = np.union1d(found, ids)
            rows += len(part)
            if len(found) > max_keys:
                raise too_many_keys(len(found), max_keys, f"at least (by row {rows} of {keys.num_rows}) ")
    if missing:
        keys.read_missing_as(_free_value(found, dtype, keys.column_names))
    if not keys.string_columns:
        return found, found, np.arange(len(found), dtype=np.int32)
    return _sorted_strings(keys.string_columns[0], found, strings, categories)


def _free_value(found: np.ndarray, dtype: np.dtype, column: Any) -> Any:
    """A value of ``dtype`` that is none of the keys ``found`` (sorted): what a null key is read as."""
    if dtype.kind == "f":
        return np.nan
    if dtype.kind == "b":
        if len(found) < 2:
            return not bool(found[0]) if len(found) else False
        raise UsageError(f"the GroupBy key column {column!r} holds True, False and nulls, and bools have no third "
                         "value to read a null as; cast it to integers (or strings) first.")
    low = np.iinfo(dtype).min
    taken = found[: np.searchsorted(found, low + len(found) + 1)]  # the first len(found) + 1 values hold a free one
    return dtype.type(low + next(i for i in range(len(found) + 1) if i >= len(taken) or taken[i] != low + i))


class KeySlots(Source):
    """A key column read as each row's slot: the rank of its key among the keys found (int32; ``MISSING``
    for a NaN key, whose row is dropped). Everything else (resuming, stamps, names) is the column's."""

    def __init__(self, keys: Source, found: np.ndarray, slots: np.ndarray, num_keys: int):
        self._keys, self._found, self._slots, self._num_keys = keys, found, slots, num_keys

    @property
    def num_rows(self) -> int:
        return self._keys.num_rows

    @property
    def spec(self) -> Any:
        return jax.ShapeDtypeStruct((), np.int32)

    def read(self, start: int, stop: int, pad_to: int | None = None) -> np.ndarray:
        raw = np.asarray(self._keys.read(start, stop, pad_to=pad_to))
        at = np.minimum(np.searchsorted(self._found, raw), len(self._found) - 1)
        return np.where(self._found[at] == raw, self._slots[at], MISSING).astype(np.int32, copy=False)

    @property
    def resumable(self) -> bool:
        return self._keys.resumable

    @property
    def sequential(self) -> bool:
        return self._keys.sequential

    @property
    def rereadable(self) -> bool:
        return self._keys.rereadable

    def state_at(self, cursor: int) -> dict[str, Any]:
        return self._keys.state_at(cursor)

    def seek(self, cursor: int, state: dict[str, Any] | None = None) -> None:
        self._keys.seek(cursor, state)

    @property
    def column_names(self) -> Any:
        return self._keys.column_names

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "keys": self._keys.describe(), "num_keys": self._num_keys}

    def stamps(self) -> dict[str, str]:
        return self._keys.stamps()
