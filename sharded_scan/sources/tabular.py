"""Columnar data users keep: Parquet and Arrow/Feather datasets, CSV files, pandas DataFrames.

Columns are chosen by name and laid out as the combiner wants its rows: one name gives
``(rows,)``, a list of names ``(rows, len(list))``, and a pytree of those a pytree of
arrays, e.g. ``columns=(["year", "income", "age"], "price")`` for ``(X, y)``; None stands for
every numeric column not named elsewhere (``columns=(None, "price")``). Every value
keeps its precision: the row dtype is the columns' common numpy type (float64 for
doubles, reduced in 64 bits: :func:`sharded_scan.dtypes.x64_scope`) unless ``dtype=`` says otherwise. Nulls become
NaN (so ``nan_policy`` applies) in float dtypes and are an error in integer ones.

Vector columns: a ``fixed_size_list`` column of numbers, a ``list`` one whose lists all have
one length (found from its first row), and a pandas column of equal-length arrays (a
``list`` in Arrow) hold ``k`` values a row: one such name gives ``(rows, k)``, and in a list
of names it takes ``k`` places (``["a", "vec"]``: ``(rows, 1 + k)``, named ``a``, ``vec[0]``,
...). A list of another length is one line naming its row and file; a null list reads as
``k`` NaNs and a null inside one as NaN (in integer dtypes both are one line, as nulls are).

String and categorical columns are read as the stable int64 ids of
:func:`~sharded_scan.hash_strings` (of their UTF-8 bytes; ``dtype="int32"``: their low 32 bits, for a backend
without 64-bit values) (``strings="hash"``, the default; ``"refuse"`` refuses
them in one line), in a source of their own (one source reads one dtype). Only combiners
that count values by key take them (``takes_string_ids``: ``TopK``, ``DistinctCount``;
the others refuse them in one line before any compute), and ``TopK`` lists the strings
themselves: the source finds the top ids' strings afterwards (:meth:`ParquetSource.strings`).
``columns=None`` reads the numeric columns (a frame of strings only: its string columns) and
warns naming every column it leaves out (:class:`~sharded_scan.errors.ColumnsLeftOut`; a file source when its
rows are first asked for, and never of the column a ``GroupBy(by=...)`` reads as its keys).

pyarrow is an optional dependency: ``pip install sharded_scan[tabular]``; Polars, where installed
(``pip install sharded_scan[fast]``), decodes Parquet and CSV (``ParquetSource(decoder=...)``,
``CsvSource(decoder=...)``), to the same rows.
"""

from __future__ import annotations

import collections
import copy
import glob
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import jax
import numpy as np

from sharded_scan.dtypes import string_ids_of_utf8
from sharded_scan.errors import ColumnsLeftOut, UsageError
from sharded_scan.sources.base import ALIGN, FileWatch, PyTree, Source, aligned_empty, file_stamp, row_spec
from sharded_scan.sources.memory import ArraySource

Columns = Any  # a name, a list of names, or a pytree of those


def _pyarrow(files: bool = False):
    """pyarrow, with ``compute`` and ``csv``; with ``files`` also ``dataset`` and ``fs``, which only files need (a
    DataFrame's job does not pay their import, about 0.02 CPU-s)."""
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.csv

        if files:
            import pyarrow.dataset  # noqa: F401 - loads the submodule
            import pyarrow.fs  # noqa: F401
    except ImportError:
        raise UsageError("reading Parquet, Arrow or CSV needs pyarrow: pip install 'sharded_scan[tabular]'.") from None
    return pyarrow


def _is_names(x: Any) -> bool:
    return isinstance(x, str) or (isinstance(x, list) and all(isinstance(n, str) for n in x))


def _leaves(columns: Columns) -> tuple[list, Any]:
    """The column selections (a name, a list of names, or None) of ``columns`` and their tree."""
    return jax.tree.flatten(columns, is_leaf=lambda x: x is None or _is_names(x))


def _each(selection: str | list[str]) -> list[str]:
    return [selection] if isinstance(selection, str) else selection


def _numeric(arrow_type: Any) -> bool:
    pa = _pyarrow()
    return pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type) or pa.types.is_boolean(arrow_type)


def _vector(arrow_type: Any) -> bool:
    """Whether ``arrow_type`` is a list (fixed-size or not) of numbers: a vector column."""
    pa = _pyarrow()
    lists = pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(
        arrow_type)
    return lists and _numeric(arrow_type.value_type)


def _text(arrow_type: Any) -> bool:
    pa = _pyarrow()
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


STRINGS = ("hash", "refuse")
ID_DTYPES = (np.dtype(np.int64), np.dtype(np.int32))  # a string column's ids: 64 bits, or their low 32 (a TPU's)


def chosen_decoder(asked: str, why_not_polars: str | None, what: str) -> str:
    """``"polars"`` where nothing keeps Polars from reading ``what``, else ``"pyarrow"``; ``decoder="polars"``
    asked where something does (``why_not_polars``) is one line."""
    if why_not_polars is None:
        return "polars"
    if asked == "polars":
        raise UsageError(f"decoder='polars' cannot read {what}: {why_not_polars}; pass decoder='auto' (pyarrow "
                         "where Polars cannot) or decoder='pyarrow'.")
    return "pyarrow"

class Selection(NamedTuple):
    """What a tabular source reads: ``columns`` (a pytree of names), the row ``dtype``, the
    ``widths`` of its vector columns (name -> values a row) and its ``strings`` (read as ids)."""

    columns: Columns
    dtype: np.dtype
    widths: dict[str, int]
    strings: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...] = ()  # (name, "'name' (type)") of the columns a None left out
    none_reads: tuple[str, ...] = ()  # the columns a None stands for
    null_as: int | None = None  # a GroupBy key column's: nulls read as this value (a value no key has), not refused

    def names(self) -> list[str]:
        """Every column name selected, sorted, once each."""
        return sorted({n for s in _leaves(self.columns)[0] for n in _each(s)})

    def leaf_shape(self, selection: str | list[str]) -> tuple[int, ...]:
        """One row of a selection: ``()`` for a scalar column, ``(k,)`` for a vector or a list."""
        if isinstance(selection, str):
            return (self.widths[selection],) if selection in self.widths else ()
        return (sum(self.widths.get(n, 1) for n in selection),)

    def spec(self) -> PyTree:
        selections, tree = _leaves(self.columns)
        return tree.unflatten([row_spec((0, *self.leaf_shape(s)), self.dtype) for s in selections])

    def column_names(self) -> Columns:
        """``columns`` with each vector column's name spelt out per value (``vec[0]``, ``vec[1]``, ...)."""

        def spelt(name: str) -> list[str]:
            return [f"{name}[{i}]" for i in range(self.widths[name])] if name in self.widths else [name]

        selections, tree = _leaves(self.columns)
        scalar = [isinstance(s, str) and s not in self.widths for s in selections]
        return tree.unflatten([s if one else [m for n in _each(s) for m in spelt(n)]
                               for s, one in zip(selections, scalar, strict=True)])

    def empty(self, num_rows: int, real: int | None = None) -> list[np.ndarray]:
        """One aligned array a selection, ``num_rows`` rows (on CPU devices placing it is zero-copy),
        the rows from ``real`` on zeroed (the padding of a last step)."""
        out = [aligned_empty((num_rows, *self.leaf_shape(s)), self.dtype) for s in _leaves(self.columns)[0]]
        for leaf in out:
            leaf[num_rows if real is None else real :] = 0
        return out


def resolve_columns(schema: Any, columns: Columns, dtype: Any, where: str, strings: str = "hash",
                    sample: Callable[[list[str]], Any] | None = None) -> Selection:
    """Checks ``columns`` against an Arrow ``schema``; returns what the source reads.

    ``columns=None`` selects every numeric (or vector) column as one ``(rows, d)`` array, or,
    when there is none, every string column; a None inside a pytree every such column the
    others do not name (``(None, "y")``: y, and X of the rest). The columns it leaves out are
    named in a warning. ``strings="hash"`` reads selected string (or categorical) columns as
    the stable int64 ids of :func:`sharded_scan.hash_strings`, for the sketches (``TopK``,
    ``DistinctCount``). ``sample(names)`` gives a table of the first rows of those ``list``
    columns, whose length the schema does not say.
    """
    if strings not in STRINGS:
        raise UsageError(f"strings must be one of {', '.join(map(repr, STRINGS))}, got {strings!r}.")
    text = [f.name for f in schema if _text(f.type)] if strings == "hash" else []
    left_out: tuple[tuple[str, str], ...] = ()
    none_reads: tuple[str, ...] = ()
    numeric = [f.name for f in schema if _numeric(f.type) or _vector(f.type)]
    selections, tree = _leaves(columns)
    if any(s is None for s in selections):
        named = {n for s in selections if s is not None for n in _each(s)}
        rest = [n for n in numeric if n not in named] or [n for n in text if n not in named]
        if not rest:
            besides = f" besides {', '.join(sorted(named))}" if named else ""
            raise UsageError(f"{where} has no numeric column{besides} (its columns: {', '.join(schema.names)}).")
        left_out = tuple((f.name, f"{f.name!r} ({f.type})") for f in schema
                         if f.name not in named and f.name not in rest)
        none_reads = tuple(rest)
        columns = tree.unflatten([rest if s is None else s for s in selections])
        selections, _ = _leaves(columns)
    if not selections or not all(_is_names(s) for s in selections):
        raise UsageError(f"columns must be a column name, a list of names, or a pytree of those; got {columns!r}.")
    for selection in selections:
        for name in _each(selection):
            if name not in schema.names:
                raise UsageError(f"{where} has no column {name!r}; its columns are: {', '.join(schema.names)}.")
            if name not in numeric and name not in text:
                text_type = _text(schema.field(name).type)
                hint = " or drop strings='refuse' to count its values by stable ids" if text_type else ""
                raise UsageError(
                    f"column {name!r} of {where} is {schema.field(name).type}, not a number; leave it out of "
                    f"columns= (the numeric ones: {', '.join(numeric)}){hint}, or encode it as integers first."
                )
    chosen = [n for s in selections for n in _each(s)]
    chosen_text = tuple(n for n in chosen if n in text)
    if chosen_text:
        if len(chosen_text) < len(chosen):
            raise UsageError(
                f"columns= of {where} mixes the string column(s) {', '.join(map(repr, chosen_text))} (not a number: "
                "read as int64 ids, for TopK and DistinctCount) with numeric ones, and a source reads one dtype; "
                f"select only string columns in one source (e.g. columns={chosen_text[0]!r}), the numbers in another."
            )
        try:
            ids = np.dtype(np.int64 if dtype is None else dtype)
        except TypeError:
            ids = None
        if ids not in ID_DTYPES:
            raise UsageError(f"string columns of {where} are read as int64 ids (dtype='int32': their low 32 bits, "
                             f"where the backend has no 64-bit values); leave dtype unset, got {dtype!r}.")
        dtype = ids
    vectors = [n for n in dict.fromkeys(chosen) if _vector(schema.field(n).type)]
    if dtype is None:
        types = [(schema.field(n).type.value_type if n in vectors else schema.field(n).type).to_pandas_dtype()
                 for n in chosen]
        dtype = np.result_type(*types)
    dtype = np.dtype(dtype)
    if not (np.issubdtype(dtype, np.number) or dtype == np.bool_):
        raise UsageError(f"dtype must be a numeric numpy dtype, got {dtype}.")
    return Selection(columns, dtype, _widths(schema, vectors, where, sample), chosen_text, left_out, none_reads)


def warn_left_out(selection: Selection, where: str, but: Sequence[str] = (), stacklevel: int = 3) -> None:
    """The warning (:class:`~sharded_scan.errors.ColumnsLeftOut`) naming the columns ``columns=None`` left out of
    ``selection``, but those of ``but`` (a ``GroupBy``'s ``by``, which is read as the keys); none when none is."""
    left = [text for name, text in selection.left_out if name not in but]
    if left:
        reads = ", ".join(n for n in selection.none_reads if n not in but)
        warnings.warn(ColumnsLeftOut(
            f"columns=None reads {reads} of {where} and leaves out {', '.join(left)}; count string columns by naming "
            "them in columns= (TopK and DistinctCount read them as ids), or name the columns you want to silence "
            "this.", [name for name, _ in selection.left_out if name not in but]), stacklevel=stacklevel)


def _widths(schema: Any, vectors: list[str], where: str, sample: Callable[[list[str]], Any] | None) -> dict[str, int]:
    """The values a row of each vector column: a fixed size, or the length of a list column's first list."""
    pa = _pyarrow()
    widths = {n: schema.field(n).type.list_size for n in vectors if pa.types.is_fixed_size_list(schema.field(n).type)}
    lists = [n for n in vectors if n not in widths]
    first = sample(lists) if lists and sample is not None else None
    for name in lists:
        lengths = pa.compute.list_value_length(first.column(name)).to_pylist() if first is not None else []
        known = [(row, n) for row, n in enumerate(lengths) if n is not None]
        if not known:
            raise UsageError(f"list column {name!r} of {where} has no list in its first rows to tell its length; "
                             "fill them, or write the column as a fixed_size_list.")
        row, widths[name] = known[0]
        if not widths[name]:
            _refuse_empty_lists(name, where, row, next(((r, n) for r, n in known if n), None), len(lengths))
    for name, k in widths.items():
        if not k:  # a fixed_size_list of 0 values
            raise UsageError(f"vector column {name!r} of {where} holds no values a row ({schema.field(name).type}): "
                             f"there is nothing in it to reduce; leave {name!r} out of columns=.")
    return widths


def _refuse_empty_lists(name: str, where: str, row: int, other: tuple[int, int] | None, rows: int) -> None:
    """One line for a list column whose first list is empty (``other``: a later row of the first ``rows`` and its
    list's length)."""
    if other is None:
        raise UsageError(f"list column {name!r} of {where} holds only empty lists in its first {rows} rows: there "
                         f"are no values a row to reduce; leave {name!r} out of columns=, or fill its lists.")
    at, k = other
    raise UsageError(
        f"list column {name!r} of {where} holds an empty list at row {row}, its first list, which sets a vector "
        f"column's length (row {at} holds {k} values): write its empty lists as nulls (read as {k} NaN values) or "
        f"pad them to {k} values, or leave {name!r} out of columns=."
    )


def table_rows(table: Any, selection: Selection, first_row: int, where: str) -> PyTree:
    """The selected columns of an Arrow ``table`` as numpy arrays (nulls as NaN)."""
    out = selection.empty(table.num_rows)
    _fill(table, selection, first_row, where, out, 0)
    return _leaves(selection.columns)[1].unflatten(out)


def check_nulls(values: Any, name: str, dtype: np.dtype, first_row: int, where: str) -> None:
    """One line when the Arrow column ``values`` holds nulls that ``dtype`` (or an id) cannot hold."""
    if values.null_count and _text(values.type):
        raise UsageError(f"string column {name!r} of {where} has nulls near row {first_row}, which have no id; "
                         "fill them (e.g. with '') first.")
    if values.null_count and not np.issubdtype(dtype, np.floating):
        raise UsageError(
            f"column {name!r} of {where} has nulls near row {first_row}, which {dtype} cannot hold; "
            "pass dtype='float32' (or float64) to read them as NaN."
        )


def _utf8_buffers(strings: Any) -> tuple[np.ndarray, np.ndarray]:
    """The UTF-8 bytes and offsets (int64, ``len + 1``) of an Arrow string array, without a copy of the bytes."""
    pa = _pyarrow()
    strings = strings.cast(pa.large_string()) if not pa.types.is_large_string(strings.type) else strings
    _, offsets, data = strings.buffers()
    offsets = np.frombuffer(offsets, np.int64)[strings.offset : strings.offset + len(strings) + 1]
    return (np.zeros(0, np.uint8) if data is None else np.frombuffer(data, np.uint8)), offsets


def _dictionary(chunk: Any) -> tuple[Any, np.ndarray]:
    """An Arrow string (or dictionary) array as its distinct strings and each row's index among them."""
    pa = _pyarrow()
    encoded = chunk if pa.types.is_dictionary(chunk.type) else pa.compute.dictionary_encode(chunk)
    return encoded.dictionary, encoded.indices.to_numpy(zero_copy_only=False)


def string_ids(chunk: Any) -> np.ndarray:
    """The int64 :func:`hash_strings` ids of an Arrow string (or dictionary) array, each distinct string hashed
    once, from its UTF-8 bytes as Arrow holds them."""
    dictionary, indices = _dictionary(chunk)
    return string_ids_of_utf8(*_utf8_buffers(dictionary))[indices]


def find_strings(chunks: Iterable[Any], ids: Iterable[int], dtype: Any = np.int64) -> dict[int, dict[str, int]]:
    """``{id: {string: rows}}``: every string of the Arrow string ``chunks`` whose id (as ``dtype``, the source's:
    int32 keeps the low 32 bits) is among ``ids``, and its rows, the chunks read to their end (two strings sharing an
    id are both found)."""
    wanted = np.unique(np.asarray(list(ids), np.int64))
    found: dict[int, dict[str, int]] = {}
    if not wanted.size:
        return found
    for chunk in chunks:
        if not len(chunk):
            continue
        dictionary, indices = _dictionary(chunk)
        keys = string_ids_of_utf8(*_utf8_buffers(dictionary)).astype(dtype)
        hit = np.flatnonzero(np.isin(keys, wanted))
        if not hit.size:
            continue
        rows = np.bincount(indices, minlength=len(keys))
        for at in hit.tolist():
            one = found.setdefault(int(keys[at]), {})
            string = dictionary[at].as_py()
            one[string] = one.get(string, 0) + int(rows[at])
    return found


def _vector_values(chunk: Any, width: int, name: str, dtype: np.dtype, first_row: int, where: str) -> Any:
    """The values of an Arrow list chunk, ``width`` a row, null lists left out; one line at a list of another length."""
    pa = _pyarrow()
    if not pa.types.is_fixed_size_list(chunk.type):
        lengths = pa.compute.fill_null(pa.compute.list_value_length(chunk), width).to_numpy()
        odd = np.flatnonzero(lengths != width)
        if len(odd):
            raise UsageError(
                f"list column {name!r} of {where} holds {int(lengths[odd[0]])} values at row {first_row + int(odd[0])} "
                f"and {width} in its first row: a vector column needs one length; pad or cut its lists, or leave it "
                "out of columns=."
            )
    values = chunk.flatten()
    check_nulls(values, name, dtype, first_row, where)
    return values.to_numpy(zero_copy_only=False).reshape(-1, width)


# Rows cast at a time: each column of a block of rows written before the next block, so the block of
# row-major output stays in cache while its columns fill it (2·10^6 rows of 8 float32 columns: 8.8 ms
# in blocks of 2^16 rows, 19 ms a whole column at a time, 14 ms in blocks of 2^14; 2 MiB of L2 a core).
FILL_BLOCK_ROWS = 1 << 16


def _fill(table: Any, selection: Selection, first_row: int, where: str, out: list[np.ndarray], offset: int) -> None:
    """Writes the rows of an Arrow table or record batch into ``out[k][offset:]``, in blocks of
    ``FILL_BLOCK_ROWS`` rows, one pass a column a block.

    Each Arrow chunk is cast straight into its place (``np.copyto``), with no whole-column or
    whole-table copy in between; the values are those of ``np.asarray(column, dtype)``.
    """
    for lo in range(0, table.num_rows, FILL_BLOCK_ROWS):
        _fill_block(table.slice(lo, FILL_BLOCK_ROWS), selection, first_row + lo, where, out, offset + lo)


def _fill_block(table: Any, selection: Selection, first_row: int, where: str, out: list[np.ndarray],
                offset: int) -> None:
    dtype = selection.dtype

    def column(name: str, target: np.ndarray) -> None:
        values = table.column(name)
        if selection.null_as is None:
            check_nulls(values, name, dtype, first_row, where)
        at = 0
        for chunk in getattr(values, "chunks", [values]):  # a table's column is chunked, a batch's is not
            if not len(chunk):
                continue
            place = target[at : at + len(chunk)]
            if selection.null_as is not None and chunk.null_count:  # a key column's missing keys (scalars)
                valid = chunk.is_valid().to_numpy(zero_copy_only=False)
                known = np.empty(int(valid.sum()), dtype)
                _fill_chunk(chunk.drop_null(), name, selection, known, first_row + at, where)
                place[valid], place[~valid] = known, selection.null_as
            else:
                _fill_chunk(chunk, name, selection, place, first_row + at, where)
            at += len(chunk)

    for name, place in _places(selection, out, slice(offset, offset + table.num_rows)):
        column(name, place)


def _places(selection: Selection, out: list[np.ndarray], rows: slice) -> Iterator[tuple[str, np.ndarray]]:
    """Each selected column's name and its place in ``out``'s ``rows``: a scalar leaf, or its columns in a
    vector leaf, in the selection's order (a column named twice: twice)."""
    for chosen, leaf in zip(_leaves(selection.columns)[0], out, strict=True):
        if isinstance(chosen, str):
            yield chosen, leaf[rows]
            continue
        at = 0
        for name in chosen:
            k = selection.widths.get(name)
            yield name, (leaf[rows, at] if k is None else leaf[rows, at : at + k])
            at += k or 1


def _fill_arrays(columns: dict[str, np.ndarray], selection: Selection, out: list[np.ndarray]) -> None:
    """Writes whole numpy columns (``{name: values}``, every row of ``out``) into ``out`` in blocks of
    ``FILL_BLOCK_ROWS`` rows, as :func:`_fill` writes Arrow chunks: ``np.copyto`` (``casting="unsafe"``), one
    call a column a block, each releasing the GIL while it casts (so a pool of threads casts in parallel)."""
    for lo in range(0, len(out[0]) if out else 0, FILL_BLOCK_ROWS):
        block = slice(lo, lo + FILL_BLOCK_ROWS)
        for name, place in _places(selection, out, block):
            np.copyto(place, columns[name][block], casting="unsafe")


def _fill_chunk(chunk: Any, name: str, selection: Selection, place: np.ndarray, first_row: int, where: str) -> None:
    """One Arrow chunk of column ``name`` cast into ``place``."""
    dtype = selection.dtype
    if name in selection.strings:
        place[:] = string_ids(chunk)
    elif name in selection.widths:
        vectors = _vector_values(chunk, selection.widths[name], name, dtype, first_row, where)
        if chunk.null_count:  # a null list: NaN values (a float dtype: check_nulls said so)
            valid = chunk.is_valid().to_numpy(zero_copy_only=False)
            place[~valid] = np.nan
            place[valid] = vectors
        else:
            np.copyto(place, vectors, casting="unsafe")
    else:
        np.copyto(place, chunk.to_numpy(zero_copy_only=False), casting="unsafe")


def _paths(path: str | os.PathLike | Sequence) -> list[str] | str:
    """A list of files for a glob or a list; a directory or URL as it is."""
    if isinstance(path, (list, tuple)):
        return [os.fspath(p) for p in path]
    path = os.fspath(path)
    if "://" not in path and any(c in path for c in "*?["):
        found = sorted(glob.glob(path))
        if not found:
            raise UsageError(f"no files match {path!r}; check the pattern.")
        return found
    return path


DECODERS = ("auto", "polars", "pyarrow")
# Decoded row groups held ahead of the reads at most (with at least one row group ahead): a pool's worth of row
# groups while they are small, fewer when they are large.
AHEAD_BYTES = 512 << 20
# decoder="auto" takes Polars for files of at least this many bytes read on average, whatever their row groups: its
# queries (several row groups each, POLARS_QUERY_BYTES) decode a file's row groups with less CPU than pyarrow's scan,
# but each file costs it a scan and a first query of its own. Files of 4 float32 columns, CPU of the reads (load 7):
# 8 MiB in 128 KiB or 1 MiB row groups 19.4 and 10.8 ms against pyarrow's 28.0 and 12.1; 2^20 rows in 4-256 KiB row
# groups 1.3-3.4x less; 1-4 MiB in 1 MiB row groups the same; 64 files of 256 KiB 63.5 against 41.4 ms.
POLARS_MIN_FILE_BYTES = 8 << 20
# Polars decodes consecutive row groups of one file in one query, up to this many bytes read (at least one row
# group): a query's fixed cost (plan, footer) is paid once for them. 4·10^6 rows x 8 float32 in 4 MiB row groups,
# the queries alone: 0.097 CPU-s a row group a query, 0.075 two, 0.067-0.070 four, 0.062 the whole file in one;
# ParquetSource's reads: 0.124 CPU-s a row group a query, 0.109 up to 8 MiB, 0.105 up to 16 MiB (40-60 MiB more
# held ahead on 2 cores).
POLARS_QUERY_BYTES = 8 << 20
# decoder="auto" reads a CSV file of at least this many bytes with Polars (where it reads the selection faster).
POLARS_MIN_CSV_BYTES = 1 << 20
CSV_BATCH_ROWS = 1 << 16  # rows of a batch Polars' CSV reader hands over
POLARS_CSV_TYPES = {"int64": "Int64", "double": "Float64", "bool": "Boolean", "string": "String",
                    "large_string": "String"}  # pyarrow's CSV types, as Polars names them
_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}
_polars_forked = False  # Polars was loaded before this process forked: its threads are gone and a query hangs


def _after_fork() -> None:
    """In a forked child, which has none of its parent's threads (nor the lock's holder): the pools are made
    again, and a Polars loaded before the fork is left alone (its queries hang there: pyarrow decodes)."""
    global _pool_lock, _polars_forked
    _pool_lock = threading.Lock()
    _pools.clear()
    _polars_forked = _polars_forked or "polars" in sys.modules


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def host_cores() -> int:
    """The cores this process may run on (its affinity), what the decoding pool is sized to."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def decode_pool(workers: int | None = None) -> ThreadPoolExecutor:
    """The process's pool of ``workers`` (default: :func:`host_cores`) decoding threads, made once and shared by
    every source: Parquet row groups decode on it ahead of the reads."""
    workers = workers or host_cores()
    with _pool_lock:
        if workers not in _pools:
            _pools[workers] = ThreadPoolExecutor(workers, thread_name_prefix="sharded_scan-decode")
        return _pools[workers]


def _polars() -> Any:
    try:
        import polars
    except ImportError:
        return None
    return polars


def _polars_reads(arrow_type: Any) -> bool:
    """Whether Polars' Parquet reader gives a column of ``arrow_type`` back as the same Arrow type (strings as
    ``large_string``, which is read the same): integers, float32/64, booleans and strings."""
    pa = _pyarrow()
    return (pa.types.is_integer(arrow_type) or pa.types.is_float32(arrow_type) or pa.types.is_float64(arrow_type)
            or pa.types.is_boolean(arrow_type) or pa.types.is_string(arrow_type)
            or pa.types.is_large_string(arrow_type))


def _same_values(got: Any, want: Any) -> bool:
    pa = _pyarrow()
    text = (pa.types.is_string, pa.types.is_large_string)
    return got == want or (any(t(got) for t in text) and any(t(want) for t in text))


class ParquetSource(Source):
    """A Parquet (or Arrow IPC / Feather) dataset, read by row range through ``pyarrow.dataset``.

    Random access: the dataset's row groups (whole files for Arrow IPC) are indexed by
    their first row when the source is built (metadata only), and a read decodes just the
    row groups it overlaps, so each process reads only its own rows.

    Args:
      path: a file, a directory, a glob, a list of files, or a URL pyarrow's filesystems
        know (``gs://``, ``s3://``). Files are read in sorted order.
      columns: see the module docstring; None for every numeric column.
      dtype: the row dtype; None for the columns' common type.
      format: ``"parquet"``, ``"ipc"``/``"feather"`` (Arrow files).
      strings: ``"hash"`` (default) reads selected string columns as stable int64 ids (see
        :func:`resolve_columns`); ``"refuse"`` refuses them in one line.
      decoder: what decodes the row groups: ``"polars"`` (Polars' Parquet reader: 1.2-1.4x less CPU a row
        group than pyarrow's on 2 cores, ``bench/decode.py``), ``"pyarrow"``, or ``"auto"`` (default): Polars
        where it is installed and reads the selection (local Parquet files of integer, float32/64, boolean and
        string columns, files of 8 MiB read or more on average: :data:`POLARS_MIN_FILE_BYTES`), else pyarrow.
        Either way the rows are the same values (``tests/test_decoders.py``).
        Polars' row groups are decoded (consecutive ones of a file in one query, up to
        :data:`POLARS_QUERY_BYTES` read) and cast into the rows' layout on a pool of :func:`host_cores` threads,
        ahead of the reads (a row group Polars fails on is read by pyarrow).
    """

    def __init__(self, path: str | os.PathLike | Sequence, columns: Columns = None, dtype: Any = None,
                 format: str = "parquet", strings: str = "hash",  # noqa: A002 - pyarrow's word
                 decoder: str = "auto"):
        pa = _pyarrow(files=True)
        self._where = str(path)
        self._label = repr(self._where)
        if decoder not in DECODERS:
            raise UsageError(f"decoder must be one of {', '.join(map(repr, DECODERS))}, got {decoder!r}.")
        self._args = {"path": path, "dtype": dtype, "format": format, "strings": strings,
                      "decoder": decoder}  # for grouped_by
        try:
            self._dataset = pa.dataset.dataset(_paths(path), format=format)
            fragments = sorted(self._dataset.get_fragments(), key=lambda f: f.path)
            units, spans = [], []
            for fragment in fragments:
                groups = getattr(fragment, "row_groups", None)
                if groups:
                    units += [(fragment.subset(row_group_ids=[g.id]), g.num_rows) for g in groups]
                    at = np.cumsum([0] + [g.num_rows for g in groups])
                    spans += [(fragment.path, int(at[i]), g.num_rows) for i, g in enumerate(groups)]
                else:
                    units.append((fragment, fragment.count_rows()))
                    spans.append(None)
        except (OSError, ValueError, pa.ArrowException) as e:
            raise UsageError(f"cannot read {self._where!r} as a {format} dataset: {str(e).splitlines()[0]}") from None
        self._units = [u for u, n in units if n]
        self._spans = [s for s, (_, n) in zip(spans, units, strict=True) if n]  # (file, its first row, rows)
        self._fragments, self._format = fragments, format
        self._paths = [f.path for f in fragments]
        self._starts = np.cumsum([0] + [n for _, n in units if n])
        filesystem = self._dataset.filesystem
        self._local = isinstance(filesystem, pa.fs.LocalFileSystem)
        self._watch = FileWatch(self._paths) if self._local else FileWatch(self._paths, _arrow_state(filesystem))
        self._select(columns, dtype, strings)

    def _select(self, columns: Columns, dtype: Any, strings: str, keys: bool = False) -> None:
        """Resolves and checks ``columns`` (metadata only) and what decodes them."""
        self._selection = resolve_columns(self._dataset.schema, columns, dtype, self._label, strings,
                                          lambda names: self._units[0].head(16, columns=names) if self._units else None)
        _check_fragments(self._fragments, self._dataset.schema, self._selection.names(), self._selection.dtype, keys)
        self._stream: _Stream | None = None
        self._tensor_columns = _tensor_columns(self._dataset.schema, self._selection)
        row_bytes = max(len(self._selection.names()) * self._selection.dtype.itemsize, 1)
        self._decoder = self._choose_decoder(self._args["decoder"], self._local,
                                             self.num_rows * row_bytes / max(len(self._paths), 1))
        self._read_before = self._starts * row_bytes  # the bytes read before each row group (and after the last)
        self._file_end = self._file_ends() if self._decoder == "polars" else None
        largest = max((int(n) for n in np.diff(self._starts)), default=1) * row_bytes
        largest = max(largest, POLARS_QUERY_BYTES) if self._decoder == "polars" else largest
        self._ahead = max(1, min(host_cores() + 1, AHEAD_BYTES // max(largest, 1)))
        self._lazy: dict[str, Any] = {}  # a file's Polars scan of the selection, made once (plan, schema)
        self._polars_types: dict[str, Any] | None = None

    def _file_ends(self) -> np.ndarray:
        """For each row group, the row group after the last of its file."""
        files = [None if span is None else span[0] for span in self._spans]
        ends = np.arange(1, len(files) + 1)
        for u in range(len(files) - 2, -1, -1):
            if files[u] is not None and files[u] == files[u + 1]:
                ends[u] = ends[u + 1]
        return ends

    def _query_end(self, unit: int, k: int) -> int:
        """The end of the row groups that the ``k``-th Polars query of a scan (0: its first) decodes from row group
        ``unit`` on: those of its file while they hold at most the bytes read of ``unit`` times ``2**k``, and
        at most :data:`POLARS_QUERY_BYTES` (at least ``unit`` itself). A scan's first rows come after one row
        group's decode; the queries' fixed cost is paid for several row groups from its third or so on."""
        read = self._read_before
        budget = min(POLARS_QUERY_BYTES, int(read[unit + 1] - read[unit]) << min(k, 32))
        end = int(np.searchsorted(read, read[unit] + budget, side="right")) - 1
        return min(max(end, unit + 1), int(self._file_end[unit]))

    def _selecting(self, columns: Columns, dtype: Any, strings: str, keys: bool = False) -> ParquetSource:
        """This dataset (not opened again) with other ``columns``: a part of :func:`grouped_by` (``keys``: the key
        column, whose nulls are not refused before the run)."""
        part = copy.copy(self)
        part._select(columns, dtype, strings, keys)
        return part

    def _choose_decoder(self, decoder: str, local: bool, file_bytes: float) -> str:
        """``"polars"`` or ``"pyarrow"``: what ``decoder`` resolves to for this dataset (``file_bytes``: the
        rows of a file, read, on average); one line for ``"polars"`` where Polars cannot read it."""
        if decoder == "pyarrow" or (decoder == "auto" and file_bytes < POLARS_MIN_FILE_BYTES):
            return "pyarrow"
        schema, names = self._dataset.schema, self._selection.names()
        odd = [f"{n!r} ({schema.field(n).type})" for n in names if not _polars_reads(schema.field(n).type)]
        why = ("Polars is not installed (pip install polars)" if _polars() is None
               else "Polars was loaded before this process forked, and hangs in a forked child" if _polars_forked
               else f"Polars reads local Parquet files, not {self._format}" if self._format != "parquet"
               else "Polars reads local files, and these are remote" if not local
               else f"Polars leaves the types of {', '.join(odd)} to pyarrow" if odd
               else None)
        return chosen_decoder(decoder, why, repr(self._where))

    @property
    def decoder(self) -> str:
        """What decodes the row groups: ``"polars"`` or ``"pyarrow"`` (``decoder="auto"`` resolved)."""
        return self._decoder

    @property
    def num_rows(self) -> int:
        return int(self._starts[-1])

    def stamps(self) -> dict[str, str]:
        """Size and modification time of every file of the dataset (local: to the nanosecond)."""
        filesystem = self._dataset.filesystem
        if isinstance(filesystem, _pyarrow(files=True).fs.LocalFileSystem):
            return {os.path.abspath(p): file_stamp(os.stat(p)) for p in self._paths}
        return {
            info.path: f"{info.size} bytes, modified {info.mtime}" for info in filesystem.get_file_info(self._paths)
        }

    @property
    def spec(self) -> PyTree:
        self._left_out_said()
        return self._selection.spec()

    def _left_out_said(self) -> None:
        """The columns ``columns=None`` left out, named once, when the rows are first asked for (not when the
        source is built: ``GroupBy(by=...)`` reads one of them as its keys, and names only the others)."""
        if self._selection.left_out:
            selection, self._selection = self._selection, self._selection._replace(left_out=())
            warn_left_out(selection, self._label, stacklevel=4)

    @property
    def column_names(self) -> Columns:
        return self._selection.column_names()

    @property
    def selected_columns(self) -> Columns:
        """``columns=`` as resolved: a None replaced by the names it stands for."""
        return self._selection.columns

    def grouped_by(self, by: str) -> Source:
        """The rows ``(column by, the columns selected here but by)``: a ``GroupBy(by=...)``'s (the dataset is not
        opened again)."""
        return grouped_by(self, by)

    def key_chunks(self) -> Iterator[Any]:
        """The Arrow chunks (nulls kept) of the one column this source reads, in order: a ``GroupBy`` key column,
        read once to find its keys (and a string column's strings)."""
        scan = _pyarrow(files=True).dataset.FileSystemDataset(self._units, self._dataset.schema, self._dataset.format,
                                                              self._dataset.filesystem)
        return (batch.column(0) for batch in scan.to_batches(columns=self._selection.names()[:1]))

    def read_missing_as(self, value: Any) -> None:
        """A key column's nulls read as ``value`` (a value no key has; ``GroupBy`` drops those rows) from now on,
        not refused."""
        self._selection = self._selection._replace(null_as=value)

    @property
    def string_columns(self) -> tuple[str, ...]:
        return self._selection.strings

    def strings(self, column: str, ids: Iterable[int]) -> dict[int, dict[str, int]]:
        """``{id: {string: rows}}`` of the strings of ``column`` whose ids are ``ids``, the dataset (that
        column only) read to its end: the few values a ``TopK`` lists, found again after the run, and
        checked (two strings sharing an id are both found)."""
        scan = _pyarrow(files=True).dataset.FileSystemDataset(self._units, self._dataset.schema, self._dataset.format,
                                                              self._dataset.filesystem)
        batches = scan.to_batches(columns=[column])
        return find_strings((batch.column(0) for batch in batches), ids, self._selection.dtype)

    def read(self, start: int, stop: int, pad_to: int | None = None) -> PyTree:
        self._left_out_said()
        first = max(int(np.searchsorted(self._starts, start, side="right")) - 1, 0)
        files = sorted({u.path for u in self._units[first : int(np.searchsorted(self._starts, stop, side="left"))]})
        with self._watch.reading(files, start, stop):  # a file changed or gone mid-run: one line
            return self._read_rows(start, stop, pad_to)

    def _read_rows(self, start: int, stop: int, pad_to: int | None = None) -> PyTree:
        """Casts the rows of each row group the range overlaps straight into one aligned array a
        leaf (``pad_to`` rows long), from one scan kept across reads (:class:`_Stream`): pyarrow
        decodes the next row groups on its threads while the rows before are cast and placed. A
        read inside one batch of columns already of the row dtype is Arrow's copy (:meth:`_row_major`)."""
        self._check_range(start, stop)
        unit = max(int(np.searchsorted(self._starts, start, side="right")) - 1, 0)
        if self._stream is None or not self._stream.reaches(start, int(self._starts[unit])):
            self._stream = _Stream(self._scan(unit), int(self._starts[unit]))
        out = None
        try:
            for batch, at in self._stream.rows(start, stop):
                lo, hi = max(start, at), min(stop, at + batch.num_rows)
                inside = (lo, hi) == (start, stop) and pad_to in (None, stop - start)  # the read inside one batch
                if isinstance(batch, _Rows):  # already in the rows' layout
                    part = [leaf[lo - at : hi - at] for leaf in batch.leaves]
                    if inside and all(leaf.ctypes.data % ALIGN == 0 for leaf in part):
                        out = part  # the decoded rows themselves: placed on CPU devices without a copy
                        continue
                    out = out or self._selection.empty(pad_to or stop - start, stop - start)
                    for leaf, rows in zip(out, part, strict=True):
                        leaf[lo - start : hi - start] = rows
                    continue
                if inside:
                    out = self._row_major(batch.slice(lo - at, hi - lo))
                    if out is not None:
                        continue
                if out is None:
                    out = self._selection.empty(pad_to or stop - start, stop - start)
                path = self._units[int(np.searchsorted(self._starts, at, side="right")) - 1].path
                _fill(batch.slice(lo - at, hi - lo), self._selection, lo, path, out, lo - start)
        except BaseException:
            self._stream = None  # a read that failed (a file changed, bad values) leaves no half-read scan behind
            raise
        if out is None:
            out = self._selection.empty(pad_to or stop - start, stop - start)
        return _leaves(self._selection.columns)[1].unflatten(out)

    def _row_major(self, batch: Any) -> list[np.ndarray] | None:
        """The rows of ``batch`` as Arrow's own row-major copy of its columns (``to_tensor``: one pass
        in C++ into a buffer of Arrow's pool, where the cast writes each column strided into a fresh
        array; 8 float32 columns read in 31 steps of 65,536 rows, 40 rounds at load 7: best 0.068
        against 0.076 s, median CPU 0.081 against 0.083 s), when the selection reads the columns as
        they are (:func:`_tensor_columns`), ``batch`` has no null, and the copy is aligned for the
        devices; else None."""
        if self._tensor_columns is None:
            return None
        batch = batch.select(self._tensor_columns)
        if any(column.null_count for column in batch.columns):
            return None
        rows = np.asarray(batch.to_tensor(row_major=True))
        return [rows] if rows.ctypes.data % ALIGN == 0 else None

    def _scan(self, unit: int) -> Iterator[Any]:
        """The record batches of the selected columns from row group ``unit`` on, in order, never across row
        groups; decoding about one row group ahead measured faster on 2 cores than pyarrow's default
        (4 fragments, 16 batches ahead), and holds less memory. Polars decodes ``self._ahead`` queries (each of
        row groups up to :data:`POLARS_QUERY_BYTES` read, :meth:`_query_end`) at a time on the
        :func:`decode_pool` (:class:`_Ahead`): at most ``self._ahead + 1`` queries' rows are held, decoded or
        decoding, ahead of the read."""
        if self._decoder == "polars" and not _polars_forked:
            return _Ahead(self._decode_query, unit, self._query_end, len(self._units), self._ahead, self._starts)
        scan = _pyarrow(files=True).dataset.FileSystemDataset(self._units[unit:], self._dataset.schema,
                                                              self._dataset.format, self._dataset.filesystem)
        return iter(scan.to_batches(columns=self._selection.names(), fragment_readahead=1, batch_readahead=4))

    def _decode(self, unit: int) -> _Rows:
        """Row group ``unit``'s rows in the layout a read returns, decoded by Polars (:meth:`_decode_query`)."""
        return self._decode_query(unit, unit + 1)[0]

    def _decode_query(self, first: int, end: int) -> list[_Rows]:
        """The rows of row groups ``first .. end - 1`` (consecutive, of one file) in the layout a read returns
        (one aligned array a leaf, a row group each; the whole query's in one where its row groups average fewer
        than ``FILL_BLOCK_ROWS`` rows), decoded by Polars in one query (its rows by their place in the file; the
        file's scan made once, :attr:`_lazy`). Numbers are cast from Polars' own arrays
        (:meth:`_polars_columns`, :func:`_fill_arrays`: the GIL released while they cast); else (strings, a key
        column's nulls, integer nulls read as float32) Polars' rows go to Arrow, in the types pyarrow gives
        (strings as ``large_string``), and are cast by :func:`_fill`, as pyarrow's batches are; a row group
        Polars reads otherwise (or a query that fails) goes to pyarrow."""
        pl, names = _polars(), self._selection.names()
        path, at = self._spans[first][0], self._spans[first][1]
        sizes = [int(n) for n in np.diff(self._starts[first : end + 1])]
        frame = None
        try:
            lazy = self._lazy.get(path)
            if lazy is None:
                lazy = self._lazy[path] = pl.scan_parquet(path, glob=False, hive_partitioning=False).select(names)
            frame = lazy.slice(at, sum(sizes)).collect()
            if frame.height != sum(sizes):
                frame = None
        except BaseException as e:  # Polars' Rust panics (pyo3's PanicException) are no Exception
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            frame = None  # pyarrow reads it, or says what is wrong (a file cut short: the read's FileWatch says so)
        if frame is not None and sum(sizes) < len(sizes) * FILL_BLOCK_ROWS:  # row groups smaller than a cast's block
            try:  # one cast for the query (Polars' columns made contiguous), not a Python round a row group
                columns = self._polars_columns(frame, sum(sizes))
            except BaseException as e:
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                columns = None
            if columns is not None:
                out = self._selection.empty(sum(sizes))
                _fill_arrays(columns, self._selection, out)
                return [_Rows(out)]
        out, offset = [], 0
        for unit, rows in zip(range(first, end), sizes, strict=True):
            out.append(self._rows(unit, None if frame is None else frame.slice(offset, rows)))
            offset += rows
        return out

    def _rows(self, unit: int, frame: Any) -> _Rows:
        """Row group ``unit``'s rows from its Polars ``frame`` (None: Polars failed on it), or pyarrow's."""
        pl, names, schema = _polars(), self._selection.names(), self._dataset.schema
        path, _, rows = self._spans[unit]
        table = None
        if frame is not None:
            try:
                columns = self._polars_columns(frame, rows)
                if columns is not None:
                    out = self._selection.empty(rows)
                    _fill_arrays(columns, self._selection, out)
                    return _Rows(out)
                table = frame.to_arrow(compat_level=pl.CompatLevel.oldest())
            except BaseException as e:
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
        if table is None or table.num_rows != rows or any(
                not _same_values(table.schema.field(n).type, schema.field(n).type) for n in names):
            table = self._units[unit].to_table(columns=names, use_threads=False)
        out = self._selection.empty(rows)
        _fill(table, self._selection, int(self._starts[unit]), path, out, 0)
        return _Rows(out)

    def _polars_columns(self, frame: Any, rows: int) -> dict[str, np.ndarray] | None:
        """The selected columns of a Polars ``frame`` as numpy arrays (``Series.to_numpy``: no copy where a column
        has no null) that :func:`_fill_arrays` casts into exactly the values :func:`_fill` casts pyarrow's chunks
        of them into: the same numpy dtype, the same ``np.copyto``. None where that is not certain: strings (ids),
        a key column's nulls, a type Polars read otherwise, and nulls but those a float dtype reads as NaN from a
        float column or, into float64, from an integer one (pyarrow makes a chunk of integers with nulls float64
        first, one without none: the same values only in float64); an integer dtype's nulls go to ``_fill``,
        which refuses them in one line."""
        selection, schema, pl = self._selection, self._dataset.schema, _polars()
        if selection.strings or selection.widths or selection.null_as is not None or frame.height != rows:
            return None
        if self._polars_types is None:  # what Polars reads each column as, when it reads it as pyarrow does
            self._polars_types = {name: pl.Series(values=np.empty(0, schema.field(name).type.to_pandas_dtype())).dtype
                                  for name in selection.names()}
        columns = {}
        for name in selection.names():
            series = frame.get_column(name)
            want = np.dtype(schema.field(name).type.to_pandas_dtype())
            if series.dtype != self._polars_types[name]:
                return None
            if series.null_count():
                if not (np.issubdtype(selection.dtype, np.floating) and (
                        want.kind == "f" or (want.kind in "iu" and selection.dtype == np.float64))):
                    return None
                want = want if want.kind == "f" else np.dtype(np.float64)
            values = series.to_numpy()
            if values.dtype != want or len(values) != rows:
                return None
            columns[name] = values
        return columns

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": self._where, "columns": repr(self._selection.columns),
                "format": self._format}


class _Rows(NamedTuple):
    """A row group's rows as a read returns them (a list of arrays, one a leaf), decoded and cast on the pool."""

    leaves: list[np.ndarray]

    @property
    def num_rows(self) -> int:
        return len(self.leaves[0])


class _Ahead:
    """The rows (:class:`_Rows`) of row groups ``first``, ``first + 1``, ... ``units - 1`` in order, decoded by
    ``decode(u, end)`` (the rows of row groups ``u .. end - 1``, one query; ``end = query_end(u, k)`` for the
    ``k``-th query) on the :func:`decode_pool`, ``ahead`` queries submitted ahead of the one being read. Those
    still waiting when it is dropped (a seek, a failed read) are cancelled."""

    def __init__(self, decode: Callable[[int, int], list], first: int, query_end: Callable[[int, int], int],
                 units: int, ahead: int, starts: np.ndarray):
        self._decode, self._next, self._query_end, self._units = decode, first, query_end, units
        self._ahead, self._starts, self._queries = ahead, starts, 0
        self._pending: collections.deque = collections.deque()
        self._ready: collections.deque = collections.deque()  # the decoded row groups of the query being read

    def horizon(self) -> int:
        """The first row of the row groups not yet submitted: the rows before it are decoded or decoding."""
        return int(self._starts[self._next])

    def __iter__(self) -> _Ahead:
        return self

    def __next__(self) -> _Rows:
        pool = decode_pool()
        while self._next < self._units and len(self._pending) < self._ahead:
            end = self._query_end(self._next, self._queries)
            self._pending.append(pool.submit(self._decode, self._next, end))
            self._next, self._queries = end, self._queries + 1
        if not self._ready:
            if not self._pending:
                raise StopIteration
            self._ready.extend(self._pending.popleft().result())
        return self._ready.popleft()

    def __del__(self) -> None:
        for future in self._pending:
            future.cancel()


class _Stream:
    """Record batches of a scan, consumed by consecutive reads: the rows of one read that
    continues where the last one ended (or skips rows of the row group it is in, or, read ahead
    on a pool, of the row groups already submitted: the rows of the other processes' parts of a
    step) come from the batches already decoded; any other read starts a new scan at its row group."""

    def __init__(self, batches: Iterator[Any], at: int):
        self._batches, self._batch, self._at = batches, None, at  # _batch: the batch at row _at, not yet passed

    def reaches(self, start: int, unit_start: int) -> bool:
        """Whether rows from ``start`` (in the row group starting at row ``unit_start``) are ahead in this scan,
        in the row group it is at (or, read ahead on a pool, in one submitted)."""
        if isinstance(self._batches, _Ahead) and (_polars_forked or self._at <= start < self._batches.horizon()):
            return not _polars_forked  # a scan of the parent's, forked: its row groups never come
        return unit_start <= self._at <= start

    def rows(self, start: int, stop: int) -> Iterator[tuple[Any, int]]:
        """``(batch, its first row)`` of every batch overlapping rows ``[start, stop)``; the last is kept for the
        next read."""
        while self._at < stop:
            if self._batch is None:
                self._batch = next(self._batches)
            end = self._at + self._batch.num_rows
            if end > start:
                yield self._batch, self._at
            if end > stop:
                return
            self._batch, self._at = None, end


def _tensor_columns(schema: Any, selection: Selection) -> list[str] | None:
    """The column names of a selection that Arrow can copy into rows as they are: one list of
    distinct scalar numeric columns (not bool), each of the row dtype; else (or before pyarrow 16,
    whose ``to_tensor`` has no ``row_major``) None."""
    if int(_pyarrow().__version__.split(".")[0]) < 16:
        return None
    selections = _leaves(selection.columns)[0]
    if len(selections) != 1 or not isinstance(selections[0], list) or selection.strings or selection.widths:
        return None
    names = selections[0]
    if len(set(names)) != len(names) or not np.issubdtype(selection.dtype, np.number):
        return None
    if any(np.dtype(schema.field(n).type.to_pandas_dtype()) != selection.dtype for n in names):
        return None
    return names


def _arrow_state(filesystem: Any) -> Any:
    """A remote file's size and modification time through its pyarrow ``filesystem``, for :class:`FileWatch`."""

    def state(path: str) -> tuple[tuple, str] | None:
        info = filesystem.get_file_info(path)
        if info.type == _pyarrow(files=True).fs.FileType.NotFound:
            return None
        return (info.size, info.mtime), f"{info.size} bytes, modified {info.mtime}"

    return state


def _check_fragments(fragments: list, schema: Any, names: list[str], dtype: np.dtype, nulls: bool = False) -> None:
    """One line before any compute when a file's selected columns differ in type from the
    dataset's (its first file's), or hold nulls that an integer ``dtype`` cannot (Parquet
    row-group statistics; files without them are checked as they are read), unless ``nulls`` (a key column's)."""
    first = fragments[0].path if fragments else "the first file"
    for fragment in fragments:
        physical = fragment.physical_schema
        for name in names:
            if name not in physical.names:
                raise UsageError(f"{fragment.path} has no column {name!r}, which {first} has: the files' schemas "
                                 "differ; select the columns every file has, or rewrite the odd file.")
            if physical.field(name).type != schema.field(name).type:
                raise UsageError(
                    f"column {name!r} is {physical.field(name).type} in {fragment.path} but "
                    f"{schema.field(name).type} in {first}: the files' schemas differ; rewrite them with one type."
                )
        metadata = getattr(fragment, "metadata", None) if not (nulls or np.issubdtype(dtype, np.floating)) else None
        for g in range(metadata.num_row_groups if metadata is not None else 0):
            group = metadata.row_group(g)
            for j in range(group.num_columns):
                column = group.column(j)
                stats = column.statistics
                if column.path_in_schema in names and stats is not None and stats.has_null_count and stats.null_count:
                    fix = ("fill them (e.g. with '') first" if _text(schema.field(column.path_in_schema).type)
                           else "pass dtype='float32' (or float64) to read them as NaN")
                    raise UsageError(
                        f"column {column.path_in_schema!r} of {fragment.path} has {stats.null_count} nulls (row group "
                        f"{g}), which {dtype} cannot hold; {fix}."
                    )


class CsvSource(Source):
    """A CSV file read forward, in order, with pyarrow's dataset scanner.

    The rows are counted once when the source is built (one streaming pass). Reads go
    forward; resuming at row ``cursor`` reopens the file and skips ``cursor`` rows, so the
    cursor alone says where to resume.

    Args:
      path: the CSV file (with a header row).
      columns: see the module docstring; None for every numeric column.
      dtype: the row dtype; None for the columns' common type.
      block_bytes: bytes pyarrow parses at a time (1 MiB blocks parse in cache: 1.4x the rate of 16 MiB
        ones on 2 cores, ``bench/tabular_streaming.py``).
      strings: as for :class:`ParquetSource`.
      decoder: what parses the rows the reads return: ``"polars"`` (Polars' CSV reader, on its own pool of
        :func:`host_cores` threads, ahead of the reads), ``"pyarrow"``, or ``"auto"`` (default): Polars where it
        is installed, the file holds at least :data:`POLARS_MIN_CSV_BYTES` and the selection is of string columns
        (where it measured faster, ``bench/decode.py --csv``), else pyarrow. Either way the rows are the same
        values (``tests/test_decoders.py``): pyarrow's counting pass sets the types (its first block's), the nulls
        (its ``null_values``; a string is never null) and what is malformed (one line); a file with blank lines
        (pyarrow skips them, Polars reads rows of nulls) is pyarrow's, and a value Polars does not parse as
        pyarrow does (``"1.5 "``, a bool ``1``) has pyarrow read the rest of the file.
    """

    def __init__(self, path: str | os.PathLike, columns: Columns = None, dtype: Any = None,
                 block_bytes: int = 1 << 20, strings: str = "hash", decoder: str = "auto"):
        pa = _pyarrow()
        if decoder not in DECODERS:
            raise UsageError(f"decoder must be one of {', '.join(map(repr, DECODERS))}, got {decoder!r}.")
        self._args = {"path": path, "dtype": dtype, "block_bytes": block_bytes, "strings": strings,
                      "decoder": decoder}  # for grouped_by
        self._path, self._block_bytes = os.fspath(path), int(block_bytes)
        self._label = repr(self._path)
        if not os.path.isfile(self._path):
            raise UsageError(f"no such CSV file: {self._path!r}; check the path.")
        try:
            self._schema = pa.csv.open_csv(self._path, read_options=self._read_options()).schema  # the types the
            # first block says, kept for every read
        except pa.ArrowException as e:
            raise UsageError(f"cannot read {self._path!r} as CSV: {str(e).splitlines()[0]}") from None
        self._selection = resolve_columns(self._schema, columns, dtype, self._label, strings)
        self._num_rows = self._counted()
        self._polars_rows: int | None = None  # the rows Polars counts (blank lines too), once asked
        self._decoder = self._choose_decoder(decoder)
        self._reader, self._position, self._buffer = None, 0, None
        self._watch = FileWatch([self._path])

    def _choose_decoder(self, decoder: str) -> str:
        """``"polars"`` or ``"pyarrow"``: what ``decoder`` resolves to for this selection; one line for
        ``"polars"`` where Polars cannot read the file as pyarrow does."""
        strings = bool(self._selection.strings)
        if decoder == "pyarrow" or (decoder == "auto" and (not strings or os.path.getsize(self._path)
                                                           < POLARS_MIN_CSV_BYTES)):
            return "pyarrow"
        pl = _polars()
        odd = [f"{n!r} ({self._schema.field(n).type})" for n in self._selection.names()
               if str(self._schema.field(n).type) not in POLARS_CSV_TYPES]
        why = ("Polars is not installed (pip install polars)" if pl is None
               else "Polars was loaded before this process forked, and hangs in a forked child" if _polars_forked
               else f"Polars leaves the types of {', '.join(odd)} to pyarrow" if odd
               else None)
        if why is None:
            if self._polars_rows is None:
                try:
                    self._polars_rows = int(pl.scan_csv(self._path, infer_schema=False, glob=False)
                                            .select(pl.len()).collect().item())
                except BaseException as e:  # Polars' Rust panics (pyo3's PanicException) are no Exception
                    if isinstance(e, (KeyboardInterrupt, SystemExit)):
                        raise
                    self._polars_rows = -1
            if self._polars_rows != self._num_rows:
                why = (f"Polars counts {self._polars_rows} rows where pyarrow counts {self._num_rows} (blank lines, "
                       "which pyarrow skips and Polars reads as rows of nulls)")
        return chosen_decoder(decoder, why, self._label)

    @property
    def decoder(self) -> str:
        """What parses the rows: ``"polars"`` or ``"pyarrow"`` (``decoder="auto"`` resolved)."""
        return self._decoder

    def _read_options(self) -> Any:
        return _pyarrow().csv.ReadOptions(block_size=self._block_bytes)

    def _counted(self) -> int:
        """The file's rows, in one pass that parses only the selected columns (others are only split), finding
        ragged lines, values not of the first block's types and nulls the row dtype cannot hold, before any
        compute."""
        pa = _pyarrow()
        names, rows = self._selection.names(), 0
        options = pa.csv.ConvertOptions(column_types=self._schema, include_columns=names)
        try:
            for batch in pa.csv.open_csv(self._path, read_options=self._read_options(), convert_options=options):
                for name in names:
                    check_nulls(batch.column(name), name, self._selection.dtype, rows, self._label)
                rows += batch.num_rows
        except pa.ArrowException as e:
            raise UsageError(f"cannot read {self._path!r} as CSV: {str(e).splitlines()[0]}") from None
        return rows

    def _selecting(self, columns: Columns, dtype: Any, strings: str, keys: bool = False) -> CsvSource:
        """This file with other ``columns``, its rows not counted again: a part of :func:`grouped_by`. Nulls are
        looked for again only where the new row dtype cannot hold them and the old one could, and not in the key
        column (``keys``), where they are missing keys."""
        part = copy.copy(self)
        part._selection = resolve_columns(self._schema, columns, dtype, self._label, strings)
        part._reader, part._position, part._buffer = None, 0, None
        floats = np.issubdtype(self._selection.dtype, np.floating)
        if floats and not keys and not np.issubdtype(part._selection.dtype, np.floating):
            part._counted()
        part._decoder = part._choose_decoder(self._args["decoder"])
        return part

    def _open_polars(self, start: int) -> Iterator[Any]:
        """The selected columns' rows from row ``start`` on as Arrow tables, parsed by Polars on its pool ahead of
        the reads, with the counting pass's types and nulls (pyarrow's ``null_values`` in numbers; a string is never
        null: an empty field is ``""``)."""
        pl, pa, names = _polars(), _pyarrow(), self._selection.names()
        types = {n: getattr(pl, POLARS_CSV_TYPES[str(self._schema.field(n).type)]) for n in names}
        text = bool(self._selection.strings)
        frame = pl.scan_csv(self._path, schema_overrides=types, infer_schema=False, glob=False,
                            null_values=None if text else pa.csv.ConvertOptions().null_values,
                            empty_string_is_null=not text)
        for batch in frame.select(names).slice(start).collect_batches(chunk_size=CSV_BATCH_ROWS):
            yield batch.to_arrow(compat_level=pl.CompatLevel.oldest())

    def _next_batch(self) -> Any:
        """The next batch of the reader; where Polars fails on a value (one pyarrow parses, as its counting pass
        did), pyarrow reads on from the same row."""
        try:
            return next(self._reader)
        except StopIteration:
            raise
        except BaseException as e:  # Polars' Rust panics (pyo3's PanicException) are no Exception
            if isinstance(e, (KeyboardInterrupt, SystemExit)) or self._decoder != "polars":
                raise
        self._decoder, self._reader = "pyarrow", _skip(self._open(), self._position)
        return next(self._reader)

    def _open(self) -> Any:
        """The selected columns' record batches in file order, with the types the counting pass
        inferred. pyarrow's dataset scan reads and splits blocks ahead on its own threads while
        this one converts: 1.4x the rate of ``pyarrow.csv.open_csv`` alone on 2 cores."""
        pa = _pyarrow(files=True)
        csv = pa.dataset.CsvFileFormat(read_options=pa.csv.ReadOptions(block_size=self._block_bytes),
                                       convert_options=pa.csv.ConvertOptions(column_types=self._schema))
        return iter(pa.dataset.dataset(self._path, format=csv).to_batches(columns=self._selection.names()))

    @property
    def num_rows(self) -> int:
        return self._num_rows

    def stamps(self) -> dict[str, str]:
        """The file's size and modification time (to the nanosecond)."""
        return {os.path.abspath(self._path): file_stamp(os.stat(self._path))}

    @property
    def spec(self) -> PyTree:
        self._left_out_said()
        return self._selection.spec()

    def _left_out_said(self) -> None:
        """The columns ``columns=None`` left out, named once, when the rows are first asked for (not when the
        source is built: ``GroupBy(by=...)`` reads one of them as its keys, and names only the others)."""
        if self._selection.left_out:
            selection, self._selection = self._selection, self._selection._replace(left_out=())
            warn_left_out(selection, self._label, stacklevel=4)

    @property
    def sequential(self) -> bool:
        return True

    @property
    def column_names(self) -> Columns:
        return self._selection.column_names()

    @property
    def selected_columns(self) -> Columns:
        """``columns=`` as resolved: a None replaced by the names it stands for."""
        return self._selection.columns

    def grouped_by(self, by: str) -> Source:
        """As :meth:`ParquetSource.grouped_by` (the file is not counted again)."""
        return grouped_by(self, by)

    def key_chunks(self) -> Iterator[Any]:
        """As :meth:`ParquetSource.key_chunks`."""
        return (batch.column(0) for batch in self._open())

    def read_missing_as(self, value: Any) -> None:
        """As :meth:`ParquetSource.read_missing_as`."""
        self._selection = self._selection._replace(null_as=value)

    @property
    def string_columns(self) -> tuple[str, ...]:
        return self._selection.strings

    def strings(self, column: str, ids: Iterable[int]) -> dict[int, dict[str, int]]:
        """As :meth:`ParquetSource.strings`: the file parsed again from its start (not this reader's place)."""
        return find_strings((batch.column(column) for batch in self._open()), ids, self._selection.dtype)

    def seek(self, cursor: int, state: dict[str, Any] | None = None) -> None:
        super().seek(cursor, state)
        self._reader, self._position, self._buffer = None, 0, None
        self.read(cursor, cursor)

    def read(self, start: int, stop: int, pad_to: int | None = None) -> PyTree:
        self._left_out_said()
        with self._watch.reading([self._path], start, stop):  # the file changed or gone mid-run: one line
            return self._read_rows(start, stop, pad_to)

    def _read_rows(self, start: int, stop: int, pad_to: int | None = None) -> PyTree:
        self._check_range(start, stop)
        if start < self._position:
            raise ValueError(f"CsvSource reads forward only: row {start} is before row {self._position}.")
        if self._reader is None and self._decoder == "polars" and not _polars_forked:
            self._reader, self._position = self._open_polars(start), start
        elif self._reader is None:
            self._reader = self._open()
        out = self._selection.empty(pad_to or stop - start, stop - start)
        while self._position < stop:
            if self._buffer is None or self._buffer.num_rows == 0:
                self._buffer = self._next_batch()
            skip = max(start - self._position, 0)
            take = min(self._buffer.num_rows, stop - self._position)
            if skip < take:
                first = self._position + skip
                _fill(self._buffer.slice(skip, take - skip), self._selection, first, repr(self._path), out,
                      first - start)
            self._buffer = self._buffer.slice(take)
            self._position += take
        return _leaves(self._selection.columns)[1].unflatten(out)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "path": os.path.abspath(self._path), "columns": repr(self._selection.columns)}


def _skip(batches: Iterator[Any], rows: int) -> Iterator[Any]:
    """``batches`` (Arrow) without their first ``rows`` rows."""
    for batch in batches:
        if rows < batch.num_rows:
            yield batch.slice(rows)
            rows = 0
        else:
            rows -= batch.num_rows
    return


def grouped_by(source: ParquetSource | CsvSource, by: str) -> Source:
    """``source``'s file(s) as rows ``(column by, the columns source selects but by)``: the keys in a
    source of their own, in their own type (strings as ids; one source reads one dtype), its nulls missing keys
    (refused only where the keys are dense, ``num_keys=N``). Both parts share ``source``'s opened dataset (its
    row count, a CSV's counting pass); the columns a ``columns=None`` left out are named now, but ``by``."""
    from sharded_scan.sources.compose import TreeSource

    def without(names: Any) -> Any:
        if isinstance(names, str):
            if names == by:
                raise UsageError(f"GroupBy by={by!r} is also a column of the data's own (columns=...); name it "
                                 "only as by.")
            return names
        return [n for n in names if n != by]

    rest = jax.tree.map(without, source.selected_columns, is_leaf=_is_names)
    selection = source._selection
    if selection.left_out:  # named now but by, which is read as the keys
        source._selection = selection._replace(left_out=())
        warn_left_out(selection, source._label, but=(by,), stacklevel=5)
    args = source._args
    return TreeSource((source._selecting(by, None, "hash", keys=True),
                       source._selecting(rest, args["dtype"], args["strings"])))


class FrameSource(ArraySource):
    """A DataFrame's selected columns in memory, with their names (``column_names``) and, for
    :meth:`strings`, its string columns as Arrow arrays."""

    def __init__(self, data: PyTree, columns: Columns, strings: dict[str, Any] | None = None):
        super().__init__(data)
        self._columns, self._strings = columns, strings or {}

    @property
    def column_names(self) -> Columns:
        return self._columns

    @property
    def string_columns(self) -> tuple[str, ...]:
        return tuple(self._strings)

    def strings(self, column: str, ids: Iterable[int]) -> dict[int, dict[str, int]]:
        """As :meth:`ParquetSource.strings`, from the frame's column."""
        return find_strings(self._strings[column].chunks, ids, jax.tree.leaves(self.spec)[0].dtype)


def dataframe_source(
    frame: Any, columns: Columns = None, dtype: Any = None, strings: str = "hash"
) -> FrameSource:
    """A pandas (or polars) DataFrame's columns as an in-memory source (see the module docstring).

    Nullable columns (pandas ``Int64``, ``Float64``) become NaN in float dtypes; columns of
    equal-length arrays (or lists) are vector columns; ``strings="hash"`` (default): string or
    categorical columns as stable int64 ids.
    """
    pa = _pyarrow()
    where = f"the {type(frame).__name__}"
    if hasattr(frame, "iloc"):
        _check_names(list(frame.columns), where)
    try:
        table = pa.Table.from_pandas(frame, preserve_index=False) if hasattr(frame, "iloc") else frame.to_arrow()
    except UnicodeEncodeError as e:  # a lone surrogate: no UTF-8 bytes (dtypes.utf8 says the same of hash_strings)
        raise UsageError(f"cannot read {where} as columns: a string holds the lone surrogate "
                         f"{e.object[e.start:e.end]!r} ({e.object[:40]!r}), which is not text and has no UTF-8 bytes; "
                         "fix its decoding (e.g. bytes.decode('utf-8', 'replace')) first.") from None
    except (AttributeError, TypeError, pa.ArrowException) as e:
        raise UsageError(f"cannot read {where} as columns: {str(e).splitlines()[0]}") from None
    selection = resolve_columns(table.schema, columns, dtype, where, strings, lambda names: table.select(names))
    warn_left_out(selection, where)
    return FrameSource(table_rows(table, selection, 0, where), selection.column_names(),
                       {name: table.column(name) for name in selection.strings})


def _check_names(names: list, where: str) -> None:
    """One line when two of a pandas frame's columns have one name, or names that are one text (``1`` and
    ``"1"``): columns are read by name, as Arrow's text."""
    seen: dict[str, Any] = {}
    for name in names:
        text = str(name)
        if text in seen:
            if seen[text] is name or (type(seen[text]) is type(name) and seen[text] == name):
                raise UsageError(f"{where} has two columns named {name!r}, and columns are read by name; rename one "
                                 "(df.columns = [...]) or drop it (df.loc[:, ~df.columns.duplicated()]).")
            raise UsageError(f"{where}'s columns {seen[text]!r} and {name!r} are one name as text ({text!r}), and "
                             "columns are read by name as text; rename one (df.columns = [...]).")
        seen[text] = name
