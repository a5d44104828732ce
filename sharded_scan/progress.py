"""Progress callbacks: the ``progress`` option checked, the tqdm bar of ``progress=True``, :func:`combine`.

``RunOptions.progress`` is ``"auto"`` (None is read so; the default), False (nothing), a
callable taking a :class:`sharded_scan.Progress` after every step, True (a tqdm bar over rows
on process 0) or a list/tuple of those. ``"auto"`` (:class:`AutoProgress`) shows progress on
process 0 only when stderr is a terminal and only once a run has gone on for
:data:`AUTO_AFTER_SECONDS`: a tqdm bar where tqdm is installed, else a line every
:data:`AUTO_EVERY_SECONDS`. :func:`check_progress` checks the option once (tqdm is optional:
``progress=True`` without it is one line); :func:`reporter` turns it into the one callable the
engine calls, and closes the bar it drew when the run ends, also when it fails. :func:`combine` chains callbacks
into one, which closes those that have a ``close`` (or are context managers) when it is
closed or its ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import jax

from sharded_scan.errors import UsageError

TQDM_HINT = "pip install tqdm (or pip install 'sharded_scan[metrics]')"
AUTO = "auto"  # progress=None or "auto", the default: AutoProgress on a terminal, for runs longer than a few seconds
AUTO_AFTER_SECONDS = 3.0  # "auto" shows nothing for a run shorter than this
AUTO_EVERY_SECONDS = 5.0  # "auto" without tqdm: a line this often


def check_progress(progress: Any) -> Any:
    """The ``progress`` option checked: ``"auto"``, None (off), True, a callable, or a tuple of those.

    None is read as ``"auto"``, False as None and a list as a tuple.

    Raises:
      UsageError: anything else, or True without tqdm installed.
    """
    if progress is None or is_auto(progress):
        return AUTO
    if progress is False:
        return None
    if isinstance(progress, (list, tuple)):
        items = tuple(item for item in progress if item is not None and item is not False)
        for item in items:
            if item is not True and not is_auto(item) and not callable(item):
                raise UsageError(f"progress items must be True, 'auto' or callables, got {type(item).__name__}.")
        if any(item is True for item in items):
            import_tqdm()
        return items
    if progress is True:
        import_tqdm()
        return True
    if not callable(progress):
        raise UsageError(f"progress must be 'auto' (None), False (off), True (a tqdm bar), a callable or a list of "
                         f"them, got {type(progress).__name__}.")
    return progress


def is_auto(progress: Any) -> bool:
    return isinstance(progress, str) and progress == AUTO


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

    def __init__(self, num_rows: int, initial: int = 0, tqdm: Any = None, **tqdm_options: Any):
        tqdm = tqdm or import_tqdm()
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


class AutoProgress:
    """``progress="auto"``: nothing for a run's first :data:`AUTO_AFTER_SECONDS` (by :class:`sharded_scan.Progress`'s
    ``seconds``), then a tqdm bar (``tqdm``, a tqdm class) from the rows done by then, or without tqdm a line to
    ``stream`` every :data:`AUTO_EVERY_SECONDS` and a last one when the rows are done: rows, percent, rows/s from
    the first step's end on (compiling left out) and the time left. :meth:`close` it at the end."""

    def __init__(self, stream: TextIO, tqdm: Any = None, after: float = AUTO_AFTER_SECONDS,
                 every: float = AUTO_EVERY_SECONDS):
        self._stream, self._tqdm, self._every = stream, tqdm, every
        self._next, self._first, self._bar, self._lines = after, None, None, 0

    def __call__(self, p: Any) -> None:
        if self._first is None:
            self._first = p
        if self._bar is not None:
            self._bar(p)
            return
        done = p.rows_done >= p.num_rows
        if p.seconds < self._next and not (done and self._lines):
            return
        if self._tqdm is not None:
            self._bar = ProgressBar(p.num_rows, p.rows_done, tqdm=self._tqdm, file=self._stream)
            return
        self._next = p.seconds + self._every
        rows, seconds = p.rows_done - self._first.rows_done, p.seconds - self._first.seconds
        rate = rows / seconds if rows > 0 and seconds > 0 else None
        left = "0 s left" if done else f"{(p.num_rows - p.rows_done) / rate:.0f} s left" if rate else "? s left"
        self._stream.write(f"sharded_scan: {p.rows_done:,}/{p.num_rows:,} rows ({100 * p.rows_done / p.num_rows:.1f}%)"
                           f", {f'{rate:,.0f}' if rate else '?'} rows/s, {left}\n")
        self._stream.flush()
        self._lines += 1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def auto_progress(stream: TextIO | None = None) -> AutoProgress | None:
    """The :class:`AutoProgress` of ``progress="auto"`` on ``stream`` (sys.stderr): None unless it is a terminal
    and this is process 0; a tqdm bar where tqdm is installed, lines without."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if not (callable(isatty) and isatty()) or jax.process_index() != 0:
        return None
    try:
        tqdm = import_tqdm()
    except UsageError:
        tqdm = None
    return AutoProgress(stream, tqdm)


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
    (nothing on the others), ``"auto"`` an :class:`AutoProgress` (:func:`auto_progress`: on a
    terminal only; none beside a bar), each closed when the block ends, also on failure; the
    caller's own callbacks are the caller's to close. None when there is nothing to call.
    """
    items = progress if isinstance(progress, tuple) else (progress,)
    calls: list[Callable[[Any], None]] = []
    bar = None
    for item in items:
        if item is True:
            if bar is None and jax.process_index() == 0:
                bar = ProgressBar(num_rows, cursor)
                calls.append(bar)
        elif is_auto(item):
            if bar is None and not any(i is True for i in items):
                bar = auto_progress()
                calls += [bar] if bar is not None else []
        elif item is not None:
            calls.append(item)
    try:
        yield None if not calls else calls[0] if len(calls) == 1 else Callbacks(tuple(calls))
    finally:
        if bar is not None:
            bar.close()
