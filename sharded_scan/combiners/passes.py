"""Reductions that read the data more than once.

A :class:`MultiPass` reduction describes its passes as a generator: it yields the
combiner of the next pass, receives that pass's result, and finally returns the
answer. :func:`sharded_scan.run` runs such a reduction pass by pass (each an ordinary
run with the same options; pass ``i`` checkpoints in its own subdirectory ``pass{i}``,
so a killed job run again skips the finished passes and resumes the one it was in).
Every pass combiner's parameters are fixed by the results before it, so the resumed job
asks the same questions.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from sharded_scan.errors import UsageError


class MultiPass:
    """Mixin for reductions that need several passes over the data."""

    @property
    def needs_passes(self) -> bool:
        """Whether this instance reads the data more than once (else it is a plain combiner)."""
        return True

    def passes(self) -> Generator[Any, Any, Any]:
        """Yields each pass's combiner, is sent its result, and returns the final result."""
        raise NotImplementedError


def reads_several_times(reduction: Any) -> bool:
    """Whether ``reduction`` is run pass by pass (a :class:`MultiPass` that needs its passes)."""
    return isinstance(reduction, MultiPass) and reduction.needs_passes


def check_one_pass(inner: Any, who: str) -> None:
    """Raises a one-line UsageError when ``inner``, wrapped by ``who`` (a one-pass wrapper such as
    ``GroupBy``), would read the data several times: run alone, one pass would be a wrong answer."""
    if reads_several_times(inner):
        raise UsageError(f"{who} runs its inner combiner in one pass, and {type(inner).__name__} with these "
                         "arguments reads the data several times (exact=True); pass exact=False (its one-pass sketch).")
