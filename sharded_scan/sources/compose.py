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


def as_source(data: Any) -> Source:
    """Wraps ``data`` as a Source.

    Args:
      data: a Source, a pandas or polars DataFrame (its numeric columns), a numpy array, a
        pytree of arrays, or a pytree of Sources (arrays may stand among them); every leaf
        needs the same number of rows.
    """
    if isinstance(data, Source):
        return data
    if type(data).__module__.split(".")[0] in ("pandas", "polars") and hasattr(data, "columns"):
        from sharded_scan.sources.tabular import dataframe_source

        return dataframe_source(data)
    if not_rows(data, [data]) is not None:
        return ArraySource(data)  # which says what the data is and what to pass instead
    leaves = jax.tree.leaves(data, is_leaf=lambda s: isinstance(s, Source))
    if not any(isinstance(s, Source) for s in leaves):
        return ArraySource(data)
    return TreeSource(jax.tree.map(lambda s: s if isinstance(s, Source) else ArraySource(s), data,
                                   is_leaf=lambda s: isinstance(s, Source)))
