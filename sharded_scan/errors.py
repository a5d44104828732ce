"""Errors a user can cause, reported as one clear line."""


class UsageError(ValueError):
    """A mistake in the user's input: data, configuration, mesh or arguments.

    The message is one line that names the problem and what to do about it. The
    launcher prints it without a traceback; library users can catch it.
    """
