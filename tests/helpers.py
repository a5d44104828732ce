"""Shared test helpers: collectives in compiled HLO, float64 references."""

import re

import numpy as np

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


def run_x64(code: str, timeout: float = 300) -> dict:
    """Runs ``code`` in a fresh Python with ``jax_enable_x64`` and 8 CPU devices; returns
    the JSON object it prints on its last line (``emit(obj)`` prints one).

    float64 checks need a process of their own: the engine reads rows on a thread, which
    a ``jax.enable_x64()`` context would not reach (its rows would be narrowed).
    """
    import json
    import os
    import subprocess
    import sys
    import textwrap

    prelude = (
        "import json, jax\n"
        "jax.config.update('jax_enable_x64', True)\n"
        "jax.config.update('jax_num_cpu_devices', 8)\n"
        "def emit(obj):\n"
        "    print(json.dumps(obj, default=float))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
        cwd=root, env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
