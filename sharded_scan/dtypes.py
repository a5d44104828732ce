"""What data types the library takes, and what it turns them into: below both sources and combiners.

Sources check their rows with :func:`check_numeric` and read string columns as
:func:`hash_strings` ids; combiners accumulate in :func:`accumulator_dtype`, and the
sketches check theirs with :func:`check_keyable`.

64-bit data (float64, int64, uint64: pandas' and Parquet's defaults) needs no flag: a run
of it is scoped under ``jax.enable_x64(True)`` (:func:`x64_scope`) where the backend has
float64 (CPU, GPU), so it reduces in 64 bits; ``jax_enable_x64`` set globally still works.
So does 32-bit integer data (int32, uint32), which float32 would round (2^24 + 1 is not a
float32): it accumulates in float64 there.
On a backend without float64 (TPU) such data is refused in one line
(:func:`check_placeable`) naming the explicit opt-in, ``dtype="float32"``: never a silent
narrowing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.errors import UsageError

WIDE_DTYPES = tuple(np.dtype(t) for t in ("float64", "int64", "uint64", "complex128"))
# Integers that JAX places as they are but float32 accumulators would round: a run of them takes 64 bits too.
ROUNDED_IN_FLOAT32 = tuple(np.dtype(t) for t in ("int32", "uint32"))
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

    Rows holding 64-bit values, or 32-bit integers, on a backend with float64 run under
    ``jax.enable_x64(True)`` (a thread-local scope: the reader thread enters it too, see
    :mod:`sharded_scan.prefetch`), so that no value is narrowed on its way to the devices
    and they accumulate in 64 bits. Anything else runs as the global ``jax_enable_x64``
    says, unchanged.
    """
    rounded = [leaf for leaf in jax.tree.leaves(spec) if np.dtype(leaf.dtype) in ROUNDED_IN_FLOAT32]
    if jax.config.jax_enable_x64 or not (wide_dtypes(spec) or rounded) or not has_float64():
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


SEED = 9001  # Apache DataSketches' hash seed (its ``DEFAULT_UPDATE_SEED``)
MURMUR_C1, MURMUR_C2 = 0x87C37B91114253D5, 0x4CF5AD432745937F  # MurmurHash3_x64_128's (combiners.sketches.murmur's too)
MURMUR_F1, MURMUR_F2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # its fmix64's
_C1, _C2, _F1, _F2 = (np.uint64(c) for c in (MURMUR_C1, MURMUR_C2, MURMUR_F1, MURMUR_F2))
ID_LOW_BITS = 26  # a string id's low bits: h1's (DataSketches' HLL slot); the rest: h2's top bits
STRING_ID_BITS = 64
STRING_RANK_BITS = 64 - ID_LOW_BITS  # h2's bits an id keeps: its leading zeros known up to 37


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _fmix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(33))
    x = x * _F1
    x = x ^ (x >> np.uint64(33))
    x = x * _F2
    return x ^ (x >> np.uint64(33))


def murmur3_128(data: np.ndarray, offsets: np.ndarray, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """``(h1, h2)`` (``uint64`` each) of MurmurHash3_x64_128 with ``seed`` of the byte strings
    ``data[offsets[i]:offsets[i + 1]]`` (an Arrow string array's buffers), vectorized over the strings:
    what DataSketches' ``hll_sketch.update(str)`` hashes a string's UTF-8 bytes with."""
    offsets = np.asarray(offsets, np.int64)
    starts, lengths = offsets[:-1], np.diff(offsets)
    data = np.concatenate([np.asarray(data, np.uint8).reshape(-1), np.zeros(16, np.uint8)])  # whole blocks
    h1 = np.full(len(starts), seed, np.uint64)
    h2 = h1.copy()
    blocks, lane = lengths // 16, np.arange(16)
    with np.errstate(over="ignore"):
        for j in range(int(blocks.max(initial=0))):
            at = np.flatnonzero(blocks > j)
            k = data[starts[at, None] + 16 * j + lane].view("<u8")
            k1, k2, a1, a2 = k[:, 0], k[:, 1], h1[at], h2[at]
            a1 = a1 ^ (_rotl(k1 * _C1, 31) * _C2)
            a1 = (_rotl(a1, 27) + a2) * np.uint64(5) + np.uint64(0x52DCE729)
            a2 = a2 ^ (_rotl(k2 * _C2, 33) * _C1)
            a2 = (_rotl(a2, 31) + a1) * np.uint64(5) + np.uint64(0x38495AB5)
            h1[at], h2[at] = a1, a2
        rest = lengths & 15
        tail = data[(starts + 16 * blocks)[:, None] + lane]
        tail = np.where(lane < rest[:, None], tail, np.uint8(0)).view("<u8")
        k1, k2 = tail[:, 0].copy(), tail[:, 1].copy()
        h2 ^= np.where(rest > 8, _rotl(k2 * _C2, 33) * _C1, np.uint64(0))
        h1 ^= np.where(rest > 0, _rotl(k1 * _C1, 31) * _C2, np.uint64(0))
        h1 ^= lengths.astype(np.uint64)
        h2 ^= lengths.astype(np.uint64)
        h1 += h2
        h2 += h1
        h1, h2 = _fmix(h1), _fmix(h2)
        h1 += h2
        h2 += h1
    return h1, h2


def string_ids_of_utf8(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The int64 :func:`hash_strings` ids of the UTF-8 byte strings ``data[offsets[i]:offsets[i + 1]]``."""
    h1, h2 = murmur3_128(data, offsets)
    low = np.uint64((1 << ID_LOW_BITS) - 1)
    return ((h2 & ~low) | (h1 & low)).view(np.int64)


def utf8(strings: Iterable[str]) -> list[bytes]:
    """The UTF-8 bytes of each string; a string that has none (a lone surrogate) is one line."""
    out = []
    for i, s in enumerate(strings):
        try:
            out.append(s.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise UsageError(
                f"string {i} ({s!r}) holds the lone surrogate {s[e.start]!r} at position {e.start}: it is not text and "
                "has no UTF-8 bytes (Arrow, Parquet and DataSketches refuse it too); fix its decoding (e.g. "
                "bytes.decode('utf-8', 'replace')) first."
            ) from None
        except AttributeError:
            raise UsageError(f"hash_strings takes strings, got {type(s).__name__} {s!r} at position {i}.") from None
    return out


def hash_strings(strings: Iterable[str]) -> np.ndarray:
    """Stable 64-bit ids of strings (int64), to count strings with ``TopK`` and ``DistinctCount`` on the devices.

    An id holds the low 26 bits of ``h1`` and the top 38 bits of ``h2``, ``(h1, h2)`` the
    MurmurHash3_x64_128 (seed 9001) of the string's UTF-8 bytes: the hash Apache DataSketches'
    ``hll_sketch.update(str)`` takes, so ``DistinctCount(datasketches=True)`` of a string column
    sets the registers DataSketches would (its slot from ``h1``, its value from ``h2``'s leading
    zeros, exact up to 37 of them: a string in 2^38 gets 39 where DataSketches may give more).
    The ids are the same in every process, run and platform; two distinct strings share one
    with probability ``2^-64`` a pair (about ``n^2 / 2^65`` shared ids among ``n`` strings:
    ``TopK`` checks the strings of the ids it lists, and ``DistinctCount`` marks a string
    column's count exact only while that is at most 1e-9). A lone surrogate (no UTF-8 bytes)
    is one line. Map the returned values back with a dict of the candidate strings' ids.
    """
    encoded = utf8(strings)
    offsets = np.cumsum([0] + [len(e) for e in encoded], dtype=np.int64)
    return string_ids_of_utf8(np.frombuffer(b"".join(encoded), np.uint8), offsets)
