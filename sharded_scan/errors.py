"""Errors a user or the machine can cause, reported as one clear line."""


class UsageError(ValueError):
    """A mistake in the user's input: data, configuration, mesh or arguments.

    The message is one line that names the problem and what to do about it. The
    launcher prints it without a traceback; library users can catch it. Where the fix
    reads differently on the command line (``--config.data.dtype=float32`` rather than
    ``x.astype(np.float32)``), ``cli`` is the line the launcher prints instead.
    """

    def __init__(self, *args: object, cli: str | None = None):
        super().__init__(*args)
        self.cli = cli or str(self)


class ColumnsLeftOut(UserWarning):
    """``columns=None`` of a tabular source left out columns it cannot read as numbers (strings, dates...):
    ``columns`` names them. Name the columns you want (``columns=[...]``) to silence it, or filter this class
    (``warnings.filterwarnings("ignore", category=ColumnsLeftOut)``)."""

    def __init__(self, message: str, columns: list[str] | None = None):
        super().__init__(message)
        self.columns = list(columns or [])


class StorageError(OSError):
    """The storage refused a write the job needs (no space, read-only, no permission, quota).

    The message is one line naming what could not be written, why, what is still intact
    and what to do; nothing already saved is lost. The launcher exits with status 5.
    ``errno`` is the storage's error number (``errno.ENOSPC``, ``errno.EROFS``, ...).
    """

    def __init__(self, code: int | None, message: str):
        super().__init__(message)
        self.errno = code
