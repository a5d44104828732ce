"""What data types the library takes, and what it turns them into: below both sources and combiners.

Sources check their rows with :func:`check_numeric` and read string columns as
:func:`hash_strings` ids; combiners accumulate in :func:`accumulator_dtype`, and the
sketches check theirs with :func:`check_keyable`.

64-bit data (float64, int64, uint64: pandas' and Parquet's defaults) needs no flag: a run
of it is scoped under ``jax.enable_x64(True)`` (:func:`x64_scope`) where the backend has
float64 (CPU, GPU), so it reduces in 64 bits; ``jax_enable_x64`` set globally still works.
On a backend without float64 (TPU) such data is refused in one line
(:func:`check_placeable`) naming the explicit opt-in, ``dtype="float32"``: never a silent
narrowing.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.errors import UsageError

WIDE_DTYPES = tuple(np.dtype(t) for t in ("float64", "int64", "uint64", "complex128"))
NO_FLOAT64 = ("tpu",)  # backends whose devices have no float64


def check_numeric(dtype: Any, who: str) -> None:
    """Raises :class:`UsageError` unless ``dtype`` is a numeric (bool, int, float) dtype."""
    dtype = np.dtype(dtype)
    numeric = jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_
    if not numeric or jnp.issubdtype(dtype, jnp.complexfloating):
        raise UsageError(
            f"{who} needs numeric data, got dtype {dtype}; convert the data to a float "
            "or integer dtype first."
        )


def accumulator_dtype(dtype: Any) -> np.dtype:
    """The float dtype to accumulate rows of ``dtype`` in: float32 at least, float64 kept.

    bfloat16, float16 and small integers accumulate in float32. With 64-bit values on
    (:func:`x64_scope` for 64-bit data, or ``jax_enable_x64``) float64 inputs, and integers
    of 32 bits or more (which float32 would round), accumulate in float64.
    """
    dtype = np.dtype(dtype)
    wide_int = np.issubdtype(dtype, np.integer) and dtype.itemsize >= 4
    if (dtype == np.float64 or wide_int) and jax.config.jax_enable_x64:
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def check_keyable(dtype, who: str) -> None:
    """Raises :class:`UsageError` unless the sketches can key ``dtype``'s values exactly.

    Every real number type can: 64-bit values in 64-bit keys, which need 64-bit values on
    the devices (:func:`check_placeable`), the rest in 32-bit keys.
    """
    check_numeric(dtype, who)
    check_placeable(jax.ShapeDtypeStruct((), dtype))


def wide_dtypes(spec: Any) -> list[np.dtype]:
    """The 64-bit dtypes among the leaves of ``spec`` (a pytree of arrays or ``jax.ShapeDtypeStruct``)."""
    return [np.dtype(leaf.dtype) for leaf in jax.tree.leaves(spec) if np.dtype(leaf.dtype) in WIDE_DTYPES]


def has_float64(platform: str | None = None) -> bool:
    """Whether devices of ``platform`` (default: JAX's default backend) compute in float64."""
    return (platform or jax.default_backend()) not in NO_FLOAT64


# Backends whose arithmetic flushes subnormal floats to zero: XLA:CPU sets flush-to-zero and
# denormals-are-zero (MXCSR FTZ/DAZ) on every thread that runs a program, unconditionally (no XLA flag
# or JAX option turns it off: `--xla_cpu_ftz=false` changes code generation only); TPUs flush them too
# (measured on a v5e: float32 1e-40 + 1e-40 is 0, 1e-40 > 0 False; the bits survive the transfer).
FLUSHES_SUBNORMALS = ("cpu", "tpu")


def holds_subnormals(rows: Any) -> bool:
    """Whether a float leaf of ``rows`` (host arrays) holds a subnormal value (nonzero, smaller in
    magnitude than the dtype's smallest normal): one pass over their bits, no float arithmetic."""
    for leaf in jax.tree.leaves(rows):
        leaf = np.asarray(leaf)
        if not jnp.issubdtype(leaf.dtype, jnp.floating) or leaf.size == 0:
            continue
        unsigned = np.dtype(f"uint{8 * leaf.dtype.itemsize}")
        tiny = np.array(jnp.finfo(leaf.dtype).tiny, leaf.dtype).view(unsigned)
        two = unsigned.type(2)
        # bits shifted left drop the sign; minus 2 wraps 0 (±0) past every subnormal
        if np.any((np.ascontiguousarray(leaf).view(unsigned) << 1) - two < (tiny << 1) - two):
            return True
    return False


def x64_scope(spec: Any) -> contextlib.AbstractContextManager:
    """Where a run over rows of ``spec`` traces, places, compiles, runs and finalizes.

    Rows holding 64-bit values on a backend with float64 run under
    ``jax.enable_x64(True)`` (a thread-local scope: the reader thread enters it too, see
    :mod:`sharded_scan.prefetch`), so that no value is narrowed on its way to the devices
    and they accumulate in 64 bits. Anything else runs as the global ``jax_enable_x64``
    says, unchanged.
    """
    if jax.config.jax_enable_x64 or not wide_dtypes(spec) or not has_float64():
        return contextlib.nullcontext()
    return jax.enable_x64(True)


def check_placeable(spec: Any) -> None:
    """Raises a one-line UsageError when placing rows of ``spec`` would narrow a value.

    With 64-bit values off (no ``jax_enable_x64``, outside :func:`x64_scope`; on a
    backend without float64) JAX turns float64 into float32 and int64 into int32 on the
    way to the devices, silently; such data must say so itself (``dtype="float32"``).
    """
    if jax.config.jax_enable_x64:
        return
    for dtype in wide_dtypes(spec):
        narrow = {"f": "float32", "i": "int32", "u": "uint32", "c": "complex64"}[dtype.kind]
        where = (f"the {jax.default_backend()} backend has no {dtype.name}" if not has_float64()
                 else "64-bit values are off here (a run turns them on itself)")
        problem = f"the data is {dtype.name} and {where}: JAX would narrow it to {narrow} on its way to the devices"
        raise UsageError(
            f"{problem}; to accept the rounding, pass the data as {narrow} (x.astype(np.{narrow}), or a source's "
            f"dtype='{narrow}').",
            cli=f"{problem}; to accept the rounding, pass --config.data.dtype={narrow}.",
        )


def hash_strings(strings: Iterable[str]) -> np.ndarray:
    """Stable 32-bit ids of strings (BLAKE2b), to count strings with :class:`TopK` on the devices.

    The ids are the same in every process and run; two distinct strings share one with
    probability ``2^-32`` per pair (about ``n^2 / 2^33`` collisions among ``n`` strings).
    Map the returned values back with a dict of the candidate strings' ids.
    """
    ids = [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=4).digest(), "little") for s in strings]
    return np.array(ids, np.uint32).view(np.int32)
