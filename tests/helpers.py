"""Shared test helpers: collectives in compiled HLO, float64 references."""

import re

import numpy as np

from bench.certified import run_x64  # noqa: F401  (float64 checks run in a subprocess)

COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|collective-permute|reduce-scatter|all-to-all)(?:-start)?\(")


def collectives(compiled_text: str) -> list[str]:
    """The cross-device collectives in a compiled HLO module's text."""
    return COLLECTIVE.findall(compiled_text)


def f64(x):
    return np.asarray(x, np.float64)


def rel_err(got, want) -> float:
    """Max absolute error, relative to the largest magnitude of ``want``."""
    got, want = f64(got), f64(want)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def assert_usage_error(call, words) -> None:
    """``call()`` raises a one-line UsageError whose message holds every one of ``words``."""
    import pytest

    from sharded_scan import UsageError

    with pytest.raises(UsageError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


def launcher_error_line(capsys, config, workdir) -> str:
    """The one line the launcher's end of a run (``launch.main``: exits and cli_wording around run_job)
    prints for the job ``config`` in ``workdir``, run in this process: asserts status 2, that line only."""
    import pytest

    from launch.main import cli_wording, run_job
    from sharded_scan.workdir import exits

    capsys.readouterr()
    with pytest.raises(SystemExit) as status, exits(), cli_wording():
        run_job(config, str(workdir))
    out = capsys.readouterr()
    lines = (out.out + out.err).splitlines()
    assert status.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]



class CrashError(Exception):
    """A stand-in for a kill, raised from a progress callback."""


def crash_at(step):
    """A progress callback that raises :class:`CrashError` once the run reaches ``step``."""

    def progress(p):
        if p.step >= step:
            raise CrashError

    return progress
