"""Values as order-preserving 32-bit keys, and a 32-bit hash: what the sketches compare and count.

The order statistics, distinct-count and frequency sketches work on ``uint32`` keys, one
per value, so that sorting, comparing and hashing are integer operations that every
backend does the same way (no float comparison, no flushing of subnormal values):

- floats (float32, and bfloat16/float16/float64 rounded to float32 first): the IEEE bits
  turned so that unsigned key order is numeric order (``-inf < ... < -0 < +0 < ... < +inf``),
  with ``-0.0`` folded onto ``+0.0`` and every NaN onto one NaN, which sorts above ``+inf``;
- signed integers (bool, int8..int32): the two's complement bits with the sign bit flipped;
- unsigned integers (uint8..uint32): the value itself.

64-bit data needs ``jax_enable_x64`` to reach the devices at all, and under it 64-bit
integers and float64 are refused in one line (:func:`check_keyable`): rounding them to 32-bit
keys would merge distinct values silently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.dtypes import check_keyable
from sharded_scan.errors import UsageError

SIGN = 0x80000000
ABS = 0x7FFFFFFF
INF_BITS = 0x7F800000
NAN_BITS = 0x7FC00000
MAX_KEY = 0xFFFFFFFF  # also the filler of unused slots: it sorts last
GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: an odd constant to tell hashes apart

FLOAT, SIGNED, UNSIGNED = "float", "signed", "unsigned"
KINDS = (FLOAT, SIGNED, UNSIGNED)
KIND_DTYPES = {FLOAT: np.float32, SIGNED: np.int32, UNSIGNED: np.uint32}
NAN_KEY = NAN_BITS | SIGN  # the key of every NaN: above +inf


def key_kind(dtype) -> str:
    """How values of ``dtype`` become keys: ``"float"``, ``"signed"`` or ``"unsigned"``."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return FLOAT
    if jnp.issubdtype(dtype, jnp.unsignedinteger) and dtype.itemsize == 4:
        return UNSIGNED
    return SIGNED


def kind_code(dtype) -> jax.Array:
    """The kind of ``dtype``'s keys as an int32 scalar, for accumulators to carry to ``finalize``."""
    return jnp.int32(KINDS.index(key_kind(dtype)))


def decode(keys: np.ndarray, code) -> np.ndarray:
    """The values (float64) of host keys whose kind is ``code`` (from :func:`kind_code`)."""
    return from_keys(keys, KIND_DTYPES[KINDS[int(code)]])


def is_float(code) -> bool:
    """Whether keys of kind ``code`` stand for floats (and so may be NaN)."""
    return KINDS[int(code)] == FLOAT


def to_keys(x: jax.Array) -> jax.Array:
    """The ``uint32`` key of every value of ``x`` (any shape), order-preserving."""
    kind = key_kind(x.dtype)
    if kind == UNSIGNED:
        return x.astype(jnp.uint32)
    if kind == SIGNED:
        return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32) ^ jnp.uint32(SIGN)
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    magnitude = bits & jnp.uint32(ABS)
    bits = jnp.where(magnitude == 0, jnp.uint32(0), bits)  # -0.0 -> +0.0 (integer test: no flushing)
    bits = jnp.where(magnitude > jnp.uint32(INF_BITS), jnp.uint32(NAN_BITS), bits)
    return jnp.where(bits >= jnp.uint32(SIGN), ~bits, bits | jnp.uint32(SIGN))


def from_keys(keys: np.ndarray, dtype) -> np.ndarray:
    """The values (float64, exact) that host ``uint32`` keys of data of ``dtype`` stand for."""
    keys = np.asarray(keys, np.uint32)
    kind = key_kind(dtype)
    if kind == UNSIGNED:
        return keys.astype(np.float64)
    if kind == SIGNED:
        return (keys ^ np.uint32(SIGN)).view(np.int32).astype(np.float64)
    bits = np.where(keys >= SIGN, keys & np.uint32(ABS), ~keys).astype(np.uint32)
    return bits.view(np.float32).astype(np.float64)


def np_float_keys(values) -> np.ndarray:
    """The keys (``uint32``) of host float values, rounded to float32 first; like :func:`to_keys`."""
    bits = np.asarray(values, np.float32).view(np.uint32)
    magnitude = bits & np.uint32(ABS)
    bits = np.where(magnitude == 0, np.uint32(0), bits)
    bits = np.where(magnitude > INF_BITS, np.uint32(NAN_BITS), bits).astype(np.uint32)
    return np.where(bits >= SIGN, ~bits, bits | np.uint32(SIGN)).astype(np.uint32)


def mix32(x: jax.Array) -> jax.Array:
    """A bijective 32-bit mixer (Wellons' lowbias32): every input bit moves about half the output bits."""
    x = x.astype(jnp.uint32)
    x ^= x >> 16
    x *= jnp.uint32(0x7FEB352D)
    x ^= x >> 15
    x *= jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def check_column_spec(spec, who: str) -> None:
    """Raises unless ``spec`` is one array of rows of shape ``(d,)`` (or scalars) of keyable values."""
    leaves = jax.tree.leaves(spec)
    if len(leaves) != 1 or not isinstance(spec, jax.ShapeDtypeStruct):
        raise UsageError(f"{who} takes one array of rows, got a pytree of {len(leaves)} leaves.")
    if len(spec.shape) > 1:
        raise UsageError(
            f"{who} works per column and needs rows of shape (d,), got rows of shape {spec.shape}; "
            "reshape the data to (rows, columns)."
        )
    check_keyable(spec.dtype, who)


def fold_if_any(mask: jax.Array, fold, acc):
    """``fold(acc)`` when the micro-batch has a real row, else ``acc`` untouched.

    The last step of a run is mostly padding micro-batches; sorting them would cost as
    much as real ones. (Where the mask is all True, XLA drops the branch.)
    """
    return jax.lax.cond(jnp.any(mask), fold, lambda acc: acc, acc)


def columns(batch: jax.Array) -> jax.Array:
    """A micro-batch ``(mb,)`` or ``(mb, d)`` as keys by column: ``(d, mb)``."""
    keys = to_keys(batch)
    return keys[None, :] if keys.ndim == 1 else keys.T
