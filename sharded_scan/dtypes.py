"""What data types the library takes, and what it turns them into: below both sources and combiners.

Sources check their rows with :func:`check_numeric` and read string columns as
:func:`hash_strings` ids; combiners accumulate in :func:`accumulator_dtype`, and the
sketches, which key values in 32 bits, refuse wider ones with :func:`check_keyable`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.errors import UsageError


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

    bfloat16, float16 and small integers accumulate in float32. Under
    ``jax_enable_x64`` float64 inputs, and integers of 32 bits or more (which float32
    would round), accumulate in float64.
    """
    dtype = np.dtype(dtype)
    wide_int = np.issubdtype(dtype, np.integer) and dtype.itemsize >= 4
    if (dtype == np.float64 or wide_int) and jax.config.jax_enable_x64:
        return np.dtype(np.float64)
    return np.dtype(np.float32)


def check_keyable(dtype, who: str) -> None:
    """Raises :class:`UsageError` unless ``dtype`` is a real number type that fits 32 bits."""
    check_numeric(dtype, who)
    dtype = np.dtype(dtype)
    if dtype.itemsize > 4 and jax.config.jax_enable_x64:
        kind = "64-bit integers" if jnp.issubdtype(dtype, jnp.integer) else "float64 values"
        raise UsageError(
            f"{who} keys values in 32 bits and got {kind} ({dtype}), which would be rounded and "
            "distinct values merged; cast the data to int32 or float32 first if that precision is enough."
        )


def hash_strings(strings: Iterable[str]) -> np.ndarray:
    """Stable 32-bit ids of strings (BLAKE2b), to count strings with :class:`TopK` on the devices.

    The ids are the same in every process and run; two distinct strings share one with
    probability ``2^-32`` per pair (about ``n^2 / 2^33`` collisions among ``n`` strings).
    Map the returned values back with a dict of the candidate strings' ids.
    """
    ids = [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=4).digest(), "little") for s in strings]
    return np.array(ids, np.uint32).view(np.int32)
