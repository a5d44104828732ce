"""DataSketches' HLL coupons of values, on the devices: MurmurHash3_x64_128 (seed 9001) of each value's 8 bytes.

Apache DataSketches' ``hll_sketch`` hashes an integer as its int64 bytes and a float as its
float64 bytes (``-0.0`` as ``0.0``, every NaN as ``0x7ff8000000000000``), and keeps in register
``h1 mod 2^p`` the maximum of ``min(clz64(h2), 62) + 1``. Registers computed so merge with its
own. The 64-bit arithmetic runs on pairs of ``uint32`` words ``(hi, lo)``, so it needs no
64-bit types (JAX without x64, TPUs); a value's 64 bits come from its order-preserving key
(:mod:`~sharded_scan.combiners.sketches.keys`) and its key kind, known when the step is traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sharded_scan.combiners.sketches.keys import KIND_DTYPES
from sharded_scan.dtypes import ID_LOW_BITS, MURMUR_C1, MURMUR_C2, MURMUR_F1, MURMUR_F2, SEED, STRING_RANK_BITS

C1, C2, F1, F2 = MURMUR_C1, MURMUR_C2, MURMUR_F1, MURMUR_F2
MAX_RANK = 63  # a register's largest value: min(clz64, 62) + 1

U32 = jnp.uint32


def _const(c: int) -> tuple[jax.Array, jax.Array]:
    return U32(c >> 32), U32(c & 0xFFFFFFFF)


def _mulhi(a: jax.Array, b: jax.Array) -> jax.Array:
    """The high 32 bits of the 64-bit product of ``uint32`` arrays (Hacker's Delight ``mulhu``)."""
    a0, a1, b0, b1 = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
    t = a1 * b0 + ((a0 * b0) >> 16)
    w1 = (t & 0xFFFF) + a0 * b1
    return a1 * b1 + (t >> 16) + (w1 >> 16)


def _mul(x, c: int):
    """``x * c mod 2^64`` of a word pair and a constant."""
    hi, lo = x
    c_hi, c_lo = _const(c)
    return _mulhi(lo, c_lo) + hi * c_lo + lo * c_hi, lo * c_lo


def _add(x, y):
    lo = x[1] + y[1]
    return x[0] + y[0] + (lo < x[1]).astype(U32), lo


def _xor(x, y):
    return x[0] ^ y[0], x[1] ^ y[1]


def _shr(x, s: int):
    """``x >> s``, ``0 < s < 64``."""
    hi, lo = x
    if s >= 32:
        return jnp.zeros_like(hi), hi >> (s - 32)
    return hi >> s, (lo >> s) | (hi << (32 - s))


def _rotl(x, r: int):
    """``x`` rotated left by ``r``, ``0 < r < 32``."""
    hi, lo = x
    return (hi << r) | (lo >> (32 - r)), (lo << r) | (hi >> (32 - r))


def _fmix(x):
    x = _xor(x, _shr(x, 33))
    x = _mul(x, F1)
    x = _xor(x, _shr(x, 33))
    x = _mul(x, F2)
    return _xor(x, _shr(x, 33))


def murmur3_8(hi: jax.Array, lo: jax.Array) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
    """``(h1, h2)`` of MurmurHash3_x64_128 with seed 9001 of the 8 little-endian bytes of ``hi:lo``."""
    seed = _const(SEED)
    k1 = _mul(_rotl(_mul((hi, lo), C1), 31), C2)
    h1 = _xor(_xor(seed, k1), _const(8))
    h2 = _xor(seed, _const(8))
    h1 = _add(h1, h2)
    h2 = _add(h2, h1)
    h1, h2 = _fmix(h1), _fmix(h2)
    h1 = _add(h1, h2)
    return h1, _add(h2, h1)


def _float32_as_float64(raw: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The float64 bits (hi, lo) of float32 bits ``raw`` (no NaN: the caller's)."""
    sign, e, f = raw & U32(0x80000000), (raw >> 23) & 0xFF, raw & 0x7FFFFF
    top = (31 - jax.lax.clz(f).astype(jnp.int32)).astype(U32)  # a subnormal's leading bit, 0..22
    m = f ^ (U32(1) << jnp.minimum(top, 31))  # the bits below it: float64's mantissa, shifted by 52 - top
    low = top <= 20
    sub_hi = ((top + 874) << 20) | jnp.where(low, m << jnp.clip(20 - top, 0, 31), m >> jnp.clip(top - 20, 0, 31))
    sub_lo = jnp.where(low, U32(0), m << jnp.clip(52 - top, 0, 31))
    normal = jnp.where(e == 0xFF, U32(0x7FF00000), ((e + 896) << 20) | (f >> 3))
    hi = jnp.where(e == 0, jnp.where(f == 0, U32(0), sub_hi), normal)
    lo = jnp.where(e == 0, jnp.where(f == 0, U32(0), sub_lo), jnp.where(e == 0xFF, U32(0), f << 29))
    return sign | hi.astype(U32), lo.astype(U32)


def value_bits(keys: jax.Array, code: int) -> tuple[jax.Array, jax.Array]:
    """The 64 bits DataSketches hashes, as ``(hi, lo)`` ``uint32``, of values given by their keys of kind ``code``
    (:data:`~.keys.KIND_DTYPES`' index)."""
    kind = KIND_DTYPES[code]
    if keys.dtype == jnp.uint64:  # float64, int64, uint64
        sign = jnp.uint64(1 << 63)
        raw = jnp.where(keys >= sign, keys & (sign - 1), ~keys) if kind.kind == "f" else keys  # NaN: 0x7ff8...
        raw = raw ^ sign if kind.kind == "i" else raw
        return (raw >> 32).astype(U32), raw.astype(U32)
    sign = U32(0x80000000)
    if kind.kind == "u":
        return jnp.zeros_like(keys), keys
    if kind.kind == "i":
        value = keys ^ sign
        return jnp.where(value >= sign, U32(0xFFFFFFFF), U32(0)), value  # sign-extended
    raw = jnp.where(keys >= sign, keys & (sign - 1), ~keys)
    hi, lo = _float32_as_float64(raw)
    return jnp.where((raw & 0x7FFFFFFF) > 0x7F800000, U32(0x7FF80000), hi), lo  # NaN: 0x7ff8000000000000


def coupons(keys: jax.Array, code: int, precision: int) -> tuple[jax.Array, jax.Array]:
    """Each value's register (``h1 mod 2^precision``, int32) and value (``min(clz64(h2), 62) + 1``, uint8), of
    keys of kind ``code``."""
    h1, h2 = murmur3_8(*value_bits(keys, code))
    index = (h1[1] & U32((1 << precision) - 1)).astype(jnp.int32)
    clz = jnp.where(h2[0] == 0, 32 + jax.lax.clz(h2[1]), jax.lax.clz(h2[0]))
    return index, (jnp.minimum(clz, 62) + 1).astype(jnp.uint8)


def string_coupons(keys: jax.Array, code: int, precision: int) -> tuple[jax.Array, jax.Array]:
    """:func:`coupons` of strings given by their :func:`~sharded_scan.hash_strings` ids (int64 keys of kind
    ``code``): an id holds the low 26 bits of the string's ``h1`` and the top 38 of its ``h2``, so the register is
    the id's low bits and the value ``min(clz64(h2), 37) + 1``: DataSketches' own but where ``h2`` starts with 38
    zeros (a string in 2^38: 39, where DataSketches' is 39 or more)."""
    hi, lo = value_bits(keys, code)
    index = (lo & U32((1 << precision) - 1)).astype(jnp.int32)
    top = lo & ~U32((1 << ID_LOW_BITS) - 1)  # the id's bits of h2
    clz = jnp.where(hi == 0, 32 + jax.lax.clz(top), jax.lax.clz(hi))
    return index, (jnp.minimum(clz, STRING_RANK_BITS) + 1).astype(jnp.uint8)
