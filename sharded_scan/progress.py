"""Progress callbacks: the ``progress`` option checked, the tqdm bar of ``progress=True``, :func:`combine`.

``RunOptions.progress`` is None, a callable taking a :class:`sharded_scan.Progress` after
every step, True (a tqdm bar over rows on process 0) or a list/tuple of those.
:func:`check_progress` checks it once (tqdm is optional: ``progress=True`` without it is
one line); :func:`reporter` turns it into the one callable the engine calls, and closes
the bar it drew when the run ends, also when it fails. :func:`combine` chains callbacks
into one, which closes those that have a ``close`` (or are context managers) when it is
closed or its ``with`` block ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

from sharded_scan.errors import UsageError

TQDM_HINT = "pip install tqdm (or pip install 'sharded_scan[metrics]')"


def check_progress(progress: Any) -> Any:
    """The ``progress`` option checked: None, True, a callable, or a tuple of True/callables.

    False is read as None and a list as a tuple.

    Raises:
      UsageError: anything else, or True without tqdm installed.
    """
    if progress is None or progress is False:
        return None
    if isinstance(progress, (list, tuple)):
        items = tuple(item for item in progress if item is not None and item is not False)
        for item in items:
            if item is not True and not callable(item):
                raise UsageError(f"progress items must be True or callables, got {type(item).__name__}.")
        if any(item is True for item in items):
            import_tqdm()
        return items
    if progress is True:
        import_tqdm()
        return True
    if not callable(progress):
        raise UsageError(
            f"progress must be True (a tqdm bar), a callable, a list of them or None, got {type(progress).__name__}."
        )
    return progress


def import_tqdm() -> Any:
    """``tqdm.auto.tqdm`` (a widget in notebooks, text elsewhere).

    Raises:
      UsageError: tqdm is not installed.
    """
    try:
        from tqdm.auto import tqdm
    except ImportError:
        raise UsageError(f"progress=True draws a tqdm bar and tqdm is not installed: {TQDM_HINT}.") from None
    return tqdm


class ProgressBar:
    """A tqdm bar over the rows of a run: total ``num_rows``, starting at ``initial`` (a resumed cursor).

    Shows rows done, rows/s (tqdm counts the rate from ``initial``) and the time left.
    Call it with each :class:`sharded_scan.Progress`; :meth:`close` it at the end.
    """

    def __init__(self, num_rows: int, initial: int = 0, **tqdm_options: Any):
        tqdm = import_tqdm()
        # k/M/G prefixes for large counts; a small job's count stays a whole number ("32", not "32.0")
        options = {"unit": "rows", "unit_scale": num_rows >= 100_000, "dynamic_ncols": True, **tqdm_options}
        self._bar = tqdm(total=int(num_rows), initial=int(initial), **options)

    def __call__(self, p: Any) -> None:
        self._bar.update(int(p.rows_done) - self._bar.n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Callbacks:
    """Progress callbacks called in order (:func:`combine` builds it); also a context manager.

    Entering it enters the callbacks that are context managers; leaving it (or
    :meth:`close`) exits them, and closes the others that have a ``close``, in reverse
    order, also when the run failed.
    """

    def __init__(self, callbacks: tuple[Callable[[Any], None], ...]):
        self.callbacks = callbacks
        self._stack: contextlib.ExitStack | None = None

    def __call__(self, p: Any) -> None:
        for callback in self.callbacks:
            callback(p)

    def __enter__(self) -> Callbacks:
        with contextlib.ExitStack() as stack:  # one that fails to enter exits those entered before it
            for callback in self.callbacks:
                if hasattr(callback, "__enter__") and hasattr(callback, "__exit__"):
                    stack.enter_context(callback)
                elif callable(getattr(callback, "close", None)):
                    stack.callback(callback.close)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: Any) -> bool:
        stack, self._stack = self._stack, None
        return bool(stack is not None and stack.__exit__(*exc))

    def close(self) -> None:
        """Closes every callback that can be closed (exits them when entered)."""
        if self._stack is not None:
            self.__exit__(None, None, None)
            return
        with contextlib.ExitStack() as stack:  # every one is closed even when one of them raises
            for callback in self.callbacks:
                if callable(getattr(callback, "close", None)):
                    stack.callback(callback.close)


def combine(*callbacks: Callable[[Any], None] | None) -> Callbacks:
    """One progress callback that calls ``callbacks`` in order (None ones skipped).

    Use it as a context manager around the run, so every part is closed (a
    ``MetricsWriter`` flushed, a ``ProfileWindow`` trace stopped) also when the run fails::

        with combine(log, writer, window) as progress:
            sharded_scan.run(combiner, data, progress=progress)

    Raises:
      UsageError: an argument is not callable.
    """
    kept = tuple(c for c in callbacks if c is not None)
    for callback in kept:
        if not callable(callback):
            raise UsageError(f"combine takes progress callbacks, got {type(callback).__name__}.")
    return Callbacks(kept)


@contextlib.contextmanager
def reporter(progress: Any, cursor: int, num_rows: int) -> Iterator[Callable[[Any], None] | None]:
    """The one callable the engine calls after every step, from a checked ``progress`` option.

    True becomes a :class:`ProgressBar` from ``cursor`` to ``num_rows`` on process 0
    (nothing on the others), closed when the block ends, also on failure; the caller's
    own callbacks are the caller's to close. None when there is nothing to call.
    """
    items = progress if isinstance(progress, tuple) else (progress,)
    calls: list[Callable[[Any], None]] = []
    bar = None
    for item in items:
        if item is True:
            if bar is None and jax.process_index() == 0:
                bar = ProgressBar(num_rows, cursor)
                calls.append(bar)
        elif item is not None:
            calls.append(item)
    try:
        yield None if not calls else calls[0] if len(calls) == 1 else Callbacks(tuple(calls))
    finally:
        if bar is not None:
            bar.close()
