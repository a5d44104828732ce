"""Several sources read together as one (``(X, y)``), and turning user data into a Source."""

from __future__ import annotations

from typing import Any

import jax

from sharded_scan.errors import UsageError
from sharded_scan.sources.base import PyTree, Source
from sharded_scan.sources.memory import ArraySource, not_rows


class TreeSource(Source):
    """A pytree of sources with equal row counts, read together (e.g. ``(X, y)``)."""

    def __init__(self, sources: PyTree):
        self._sources, self._treedef = jax.tree.flatten(sources, is_leaf=lambda s: isinstance(s, Source))
        if not self._sources or not all(isinstance(s, Source) for s in self._sources):
            raise UsageError("TreeSource needs a non-empty pytree whose leaves are all Sources.")
        counts = [s.num_rows for s in self._sources]
        if len(set(counts)) > 1:
            names = ", ".join(f"{type(s).__name__}: {n}" for s, n in zip(self._sources, counts, strict=True))
            raise UsageError(f"the sources have different row counts ({names}); every source needs the same rows.")

    @property
    def parts(self) -> PyTree:
        """The pytree of sources read together."""
        return self._treedef.unflatten(self._sources)

    @property
    def num_rows(self) -> int:
        return self._sources[0].num_rows

    @property
    def spec(self) -> PyTree:
        return self._treedef.unflatten([s.spec for s in self._sources])

    @property
    def resumable(self) -> bool:
        return all(s.resumable for s in self._sources)

    @property
    def sequential(self) -> bool:
        return any(s.sequential for s in self._sources)

    @property
    def rereadable(self) -> bool:
        return all(s.rereadable for s in self._sources)

    def read(self, start: int, stop: int, pad_to: int | None = None) -> PyTree:
        return self._treedef.unflatten([s.read(start, stop, pad_to=pad_to) for s in self._sources])

    def state_at(self, cursor: int) -> dict[str, Any]:
        states = [s.state_at(cursor) for s in self._sources]
        return {"sources": states} if any(states) else {}

    def seek(self, cursor: int, state: dict[str, Any] | None = None) -> None:
        states = (state or {}).get("sources") or [{}] * len(self._sources)
        for s, st in zip(self._sources, states, strict=True):
            s.seek(cursor, st)

    def describe(self) -> dict[str, Any]:
        return {"source": "TreeSource", "sources": self._treedef.unflatten([s.describe() for s in self._sources])}

    def stamps(self) -> dict[str, str]:
        return {path: stamp for s in self._sources for path, stamp in s.stamps().items()}

    @property
    def string_columns(self) -> tuple[str, ...]:
        return tuple(name for s in self._sources for name in s.string_columns)

    def strings(self, column: str, ids: Any) -> dict[int, dict[str, int]]:
        """The strings of the source that reads ``column`` as ids (``(keys, frame)`` of a ``GroupBy``...)."""
        return next((s.strings(column, ids) for s in self._sources if column in s.string_columns), {})

    @property
    def column_names(self) -> Any:
        names = [s.column_names for s in self._sources]
        return None if all(n is None for n in names) else self._treedef.unflatten(names)


class SourcePart:
    """The part at ``path`` (indices into the row's pytree) of every row of ``source``, as far as naming
    a result's columns goes (``spec``, ``column_names``, ``string_columns``, ``strings``): the data of
    ``(keys, data)`` or ``(weights, data)`` that a ``GroupBy`` or ``Weighted`` result describes."""

    counts_rows = False  # a GroupBy or Weighted result counts this part's values per key or by weight

    def __init__(self, source: Source, path: tuple[int, ...]):
        self._source, self._path = source, tuple(path)

    def _at(self, tree: Any) -> Any:
        for i in self._path:
            tree = None if tree is None else tree[i]
        return tree

    @property
    def spec(self) -> PyTree:
        return self._at(self._source.spec)

    @property
    def column_names(self) -> Any:
        return self._at(self._source.column_names)

    @property
    def string_columns(self) -> tuple[str, ...]:
        return self._source.string_columns

    def strings(self, column: str, ids: Any) -> dict[int, dict[str, int]]:
        return self._source.strings(column, ids)


def part_of(source: Source, path: tuple[int, ...]) -> Source | SourcePart:
    """``source``, or its part at ``path`` (:class:`SourcePart`) when ``path`` is not empty."""
    return SourcePart(source, path) if path else source


def _tabular(data: Any) -> bool:
    """Whether ``data`` is a pandas or polars DataFrame or Series."""
    return type(data).__module__.split(".")[0] in ("pandas", "polars") and (
        hasattr(data, "columns") or hasattr(data, "to_frame"))


def _tabular_source(data: Any, alone: bool) -> Source:
    """A DataFrame's numeric columns; a Series as one named column: ``(rows, 1)`` when it is the
    whole data, ``(rows,)`` (e.g. ``y`` in ``(X, y)``) inside a pytree."""
    from sharded_scan.sources.tabular import dataframe_source

    if hasattr(data, "columns"):
        return dataframe_source(data)
    name = str(data.name) if getattr(data, "name", None) not in (None, "") else "0"
    frame = data.to_frame(name=name) if hasattr(data, "iloc") else data.rename(name).to_frame()
    return dataframe_source(frame, columns=[name] if alone else name)


def as_source(data: Any) -> Source:
    """Wraps ``data`` as a Source.

    Args:
      data: a Source, a pandas or polars DataFrame (its numeric columns, named), a Series
        (one named column), a numpy array, a pytree of arrays, or a pytree of Sources
        (arrays, DataFrames and Series may stand among them: ``(df, series)`` keeps their
        names, the Series as ``y`` of shape ``(rows,)``); every leaf needs the same number of rows.
    """
    if isinstance(data, Source):
        return data
    if _tabular(data):
        return _tabular_source(data, alone=True)
    if not_rows(data, [data]) is not None:
        return ArraySource(data)  # which says what the data is and what to pass instead

    def is_leaf(s):
        return isinstance(s, Source) or _tabular(s)

    if not any(map(is_leaf, jax.tree.leaves(data, is_leaf=is_leaf))):
        return ArraySource(data)
    return TreeSource(jax.tree.map(
        lambda s: s if isinstance(s, Source) else _tabular_source(s, alone=False) if _tabular(s) else ArraySource(s),
        data, is_leaf=is_leaf))
