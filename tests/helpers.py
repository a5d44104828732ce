"""Shared test helpers: collectives in compiled HLO, float64 references."""

import re

import numpy as np

from bench.certified import run_x64  # noqa: F401  (float64 checks run in a subprocess)

COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|collective-permute|reduce-scatter|all-to-all)(?:-start)?\(")


# XLA:CPU's own values of the three flags of codegen.FAST_COMPILE: a step compiled with them explicitly compiles on
# XLA's defaults, as in a user's process (the suite's XLA_FLAGS name the cheap setting: tests/conftest.py).
XLA_DEFAULTS = (("xla_cpu_use_fusion_emitters", True), ("xla_backend_optimization_level", 3),
                ("xla_cpu_parallel_codegen_split_count", 32))


def collectives(compiled_text: str) -> list[str]:
    """The cross-device collectives in a compiled HLO module's text."""
    return COLLECTIVE.findall(compiled_text)


def f64(x):
    return np.asarray(x, np.float64)


def rel_err(got, want) -> float:
    """Max absolute error, relative to the largest magnitude of ``want``."""
    got, want = f64(got), f64(want)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def assert_to_rounding(got, want, exact=(), tol=1e-6) -> None:
    """``got`` is ``want`` as far as the code pins it: bitwise in its integer and boolean leaves and in
    the float fields named in ``exact`` (values selected, never computed: minima, maxima); every other
    float leaf to float32 rounding: NaN and infinities where ``want`` has them, the rest within ``tol``
    of ``want`` relative to the leaf's largest magnitude (:func:`rel_err`).

    For results of programs of other shapes (a state split over ``model`` against the whole one, a
    ``psum`` over processes against one process's): XLA:CPU fuses their float arithmetic otherwise,
    contracting other multiply-adds into FMAs where the CPU has them (DESIGN.md, ``logical_shards``).
    """
    import jax

    fields = want._fields if hasattr(want, "_fields") else None
    for name, mine, value in zip(fields, got, want, strict=True) if fields else [("", got, want)]:
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(value), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, a.dtype, b.shape, b.dtype)
            if name in exact or not np.issubdtype(b.dtype, np.floating):
                np.testing.assert_array_equal(a, b, err_msg=name)
                continue
            finite = np.isfinite(b)
            np.testing.assert_array_equal(np.where(finite, 0, a), np.where(finite, 0, b), err_msg=name)
            if finite.any():
                err = rel_err(a[finite], b[finite])
                assert err <= tol, f"{name}: {err:.2e} apart, relative to its largest magnitude (tol {tol:.0e})"


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


def control_flow(jaxpr):
    """The conds, loops and sorts of a traced ``jaxpr``, nested as traced (``jax.vmap`` turns a ``lax.cond`` of a
    batched predicate into a select of both branches: its sorts then sit outside any cond); of a choice by platform
    (``jax.lax.platform_dependent``, which a program lowers as its platform's branch alone), the CPU's branch's."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond" and eqn.params.get("branches_platforms"):
            out.extend(control_flow(cpu_branch(eqn).jaxpr))
            continue
        params = [p for v in eqn.params.values() for p in (v if isinstance(v, tuple | list) else (v,))]
        subs = [getattr(p, "jaxpr", p) for p in params]  # a cond's branches, a loop's body, a jit's
        subs = tuple(flow for flow in (control_flow(sub) for sub in subs if hasattr(sub, "eqns")) if flow)
        if eqn.primitive.name in ("cond", "while", "sort") or subs:
            out.append((eqn.primitive.name, subs))
    return tuple(out)


def cpu_branch(eqn):
    """The branch a CPU's program lowers of a choice by platform (a ``cond`` with ``branches_platforms``)."""
    platforms = eqn.params["branches_platforms"]
    return eqn.params["branches"][next((i for i, p in enumerate(platforms) if p and "cpu" in p), platforms.index(None))]
