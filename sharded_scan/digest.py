"""Digests that let a restore tell a checkpoint's bytes from what was saved.

:func:`array_digests` reduces each leaf of a pytree of arrays to 64 bits on the devices:
the leaf read as 32-bit words, their wrapping sum (any one changed word changes it) and
the wrapping sum of a hash of each word mixed with its position (two changes cancel
with odds of 2^-32). Both sums are exact and order-free, so a global array gives the
same digest on any mesh, however it is sharded, and so does its whole host copy.
:func:`json_digest` is a SHA-256 of JSON in a canonical form, :func:`stream_digest` one of a
file's bytes, and :func:`keyed_digest` an HMAC-SHA256 (a digest only the key's holders can make).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, BinaryIO

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def _mix(x: Any, xp: Any = jnp) -> Any:
    """MurmurHash3's 32-bit finaliser: every input bit moves about half the output bits."""
    x = x ^ (x >> 16)
    x = x * xp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * xp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The leaf's bytes as flat uint32 words (narrower items widened one to a word)."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = np.dtype(x.dtype).itemsize
    if size >= 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)


def _host_words(x: np.ndarray) -> np.ndarray:
    """:func:`_words` of a host array, word for word (little-endian words in memory order)."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    size = x.dtype.itemsize
    if size >= 4:
        return x.view(np.dtype("<u4")).reshape(-1)
    return x.view({1: np.uint8, 2: np.dtype("<u2")}[size]).astype(np.uint32).reshape(-1)


def _pair(w: Any, xp: Any) -> Any:
    position = xp.arange(w.size, dtype=xp.uint32)
    return xp.stack([xp.sum(w, dtype=xp.uint32), xp.sum(_mix(w ^ _mix(position, xp), xp), dtype=xp.uint32)])


@jax.jit
def _sums(tree: PyTree) -> list[jax.Array]:
    return [_pair(_words(leaf), jnp) for leaf in jax.tree.leaves(tree)]


def array_digests(tree: PyTree) -> list[str]:
    """One 16-hex-digit digest per leaf of ``tree`` (jax or numpy arrays), in leaf order.

    With jax arrays sharded over several processes, every process must call it (it
    runs one small reduction over all devices) and all get the same digests. Where every
    leaf is on this process, the same sums are taken on the host (no program to compile).
    """
    leaves = jax.tree.leaves(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        with np.errstate(over="ignore"):
            sums = [_pair(_host_words(np.asarray(x)), np) for x in leaves]
    else:
        sums = jax.device_get(_sums(jax.tree.map(_as_array, tree)))
    return [f"{int(s[0]):08x}{int(s[1]):08x}" for s in sums]


def _as_array(x: Any) -> Any:
    return x if isinstance(x, jax.Array) else np.asarray(x)


def canonical_json(value: Any) -> str:
    """``value`` as JSON with sorted keys and no spaces: the form :func:`json_digest` hashes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=repr)


def json_digest(value: Any) -> str:
    """SHA-256 (hex) of ``value`` in canonical JSON."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def stream_digest(f: BinaryIO, block: int = 1 << 20) -> str:
    """SHA-256 (hex) of the bytes of the binary file ``f`` from where it stands, read ``block`` bytes at a time."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: f.read(block), b""):
        digest.update(chunk)
    return digest.hexdigest()


def keyed_digest(key: bytes, text: str) -> str:
    """HMAC-SHA256 (hex) of ``text`` under ``key``."""
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def same_digest(a: str, b: str) -> bool:
    """Whether two hex digests are equal, in time that does not depend on where they differ."""
    return hmac.compare_digest(a.encode(), b.encode())
