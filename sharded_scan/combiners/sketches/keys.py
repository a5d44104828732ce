"""Values as order-preserving integer keys, and their hashes: what the sketches compare and count.

The order statistics, distinct-count and frequency sketches work on unsigned integer
keys, one per value, so that sorting, comparing and hashing are integer operations that
every backend does the same way (no float comparison, no flushing of subnormal values).
Values of 64 bits (float64, int64, uint64) get ``uint64`` keys, exactly (such data runs
with 64-bit values on, :func:`sharded_scan.dtypes.x64_scope`); every other type ``uint32``
keys, as before:

- floats (float32, and bfloat16/float16 widened to float32 first; float64): the IEEE bits
  turned so that unsigned key order is numeric order (``-inf < ... < -0 < +0 < ... < +inf``),
  with ``-0.0`` folded onto ``+0.0`` and every NaN onto one NaN, which sorts above ``+inf``;
- signed integers (bool, int8..int32; int64): the two's complement bits with the sign bit flipped;
- unsigned integers (uint32; uint64): the value itself (uint8 and uint16 key as signed).

So no two distinct values share a key, and none is rounded.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sharded_scan.dtypes import check_keyable
from sharded_scan.errors import UsageError


class Bits(NamedTuple):
    """The key type of one width and the float bit patterns its keys are made from."""

    key: type     # the key dtype
    sign: int     # the sign bit
    abs: int      # every bit but the sign
    inf: int      # the bits of +inf
    nan: int      # the bits of the one NaN every NaN becomes


BITS32 = Bits(np.uint32, 0x80000000, 0x7FFFFFFF, 0x7F800000, 0x7FC00000)
BITS64 = Bits(np.uint64, 1 << 63, (1 << 63) - 1, 0x7FF0000000000000, 0x7FF8000000000000)
GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: an odd constant to tell hashes apart

# What values are keyed as, by kind code (what accumulators carry to finalize): the 32-bit
# kinds first, so that their codes are what they were before 64-bit keys.
KIND_DTYPES = tuple(np.dtype(t) for t in ("float32", "int32", "uint32", "float64", "int64", "uint64"))


def keyed_as(dtype) -> np.dtype:
    """The dtype whose bits make the keys of values of ``dtype`` (one of :data:`KIND_DTYPES`)."""
    dtype = np.dtype(dtype)
    wide = dtype.itemsize == 8
    if jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(np.float64 if wide else np.float32)
    if jnp.issubdtype(dtype, jnp.unsignedinteger) and dtype.itemsize >= 4:
        return np.dtype(np.uint64 if wide else np.uint32)
    return np.dtype(np.int64 if wide else np.int32)


def bits(dtype) -> Bits:
    """The key width of values of ``dtype``: 64 bits for 64-bit values, else 32."""
    return BITS64 if keyed_as(dtype).itemsize == 8 else BITS32


def key_dtype(dtype) -> np.dtype:
    """The key dtype of values of ``dtype``: ``uint64`` for 64-bit values, else ``uint32``."""
    return np.dtype(bits(dtype).key)


def fill(key_type) -> np.generic:
    """The largest key of ``key_type`` (``uint32`` or ``uint64``): the filler of unused slots, sorting last."""
    key_type = np.dtype(key_type)
    return key_type.type(np.iinfo(key_type).max)


def empty_slot(dtype) -> np.generic:
    """What unused slots of a sketch hold: the filler for keys, 0 for weights."""
    return fill(dtype) if jnp.issubdtype(dtype, jnp.unsignedinteger) else np.dtype(dtype).type(0)


def nan_key(key_type) -> np.generic:
    """The key of every NaN among float keys of ``key_type``: above +inf."""
    b = BITS64 if np.dtype(key_type).itemsize == 8 else BITS32
    return b.key(b.nan | b.sign)


def finite_keys(keys: jax.Array, kind: jax.Array) -> jax.Array:
    """Where keys of kind ``kind`` (:func:`kind_code`, traced) stand for finite values: below NaN's key for
    floats (the filler of padding sorts above it too), everywhere for integers."""
    floats = jnp.asarray([t.kind == "f" for t in KIND_DTYPES])[kind]
    return (keys < nan_key(keys.dtype)) | ~floats


def kind_code(dtype) -> jax.Array:
    """The kind of ``dtype``'s keys as an int32 scalar, for accumulators to carry to ``finalize``."""
    return jnp.int32(KIND_DTYPES.index(keyed_as(dtype)))


def decode(keys: np.ndarray, code) -> np.ndarray:
    """The values of host keys whose kind is ``code`` (from :func:`kind_code`), as :func:`from_keys`."""
    return from_keys(keys, KIND_DTYPES[int(code)])


def is_float(code) -> bool:
    """Whether keys of kind ``code`` stand for floats (and so may be NaN)."""
    return KIND_DTYPES[int(code)].kind == "f"


def to_keys(x: jax.Array) -> jax.Array:
    """The key of every value of ``x`` (any shape), order-preserving: ``uint64`` for 64-bit values, else ``uint32``."""
    t, b = keyed_as(x.dtype), bits(x.dtype)
    if t.kind == "u":
        return x.astype(b.key)
    if t.kind == "i":
        return jax.lax.bitcast_convert_type(x.astype(t), b.key) ^ b.key(b.sign)
    raw = jax.lax.bitcast_convert_type(x.astype(t), b.key)
    magnitude = raw & b.key(b.abs)
    raw = jnp.where(magnitude == 0, b.key(0), raw)  # -0.0 -> +0.0 (integer test: no flushing)
    raw = jnp.where(magnitude > b.key(b.inf), b.key(b.nan), raw)
    return jnp.where(raw >= b.key(b.sign), ~raw, raw | b.key(b.sign))


def from_keys(keys: np.ndarray, dtype) -> np.ndarray:
    """The values, exactly, that host keys of data of ``dtype`` stand for: float64 for floats,
    int64 for signed integers, uint64 for unsigned ones (uint32 keys: int64)."""
    t, b = keyed_as(dtype), bits(dtype)
    keys = np.asarray(keys).astype(b.key)
    if t.kind == "u":
        return keys.astype(np.uint64 if t.itemsize == 8 else np.int64)
    if t.kind == "i":
        return (keys ^ b.key(b.sign)).view(t).astype(np.int64)
    raw = np.where(keys >= b.sign, keys & b.key(b.abs), ~keys).astype(b.key)
    return raw.view(t).astype(np.float64)


def np_float_keys(values, dtype=np.float32) -> np.ndarray:
    """The keys of host float values, rounded to ``dtype`` (float32 or float64) first; like :func:`to_keys`."""
    b = bits(dtype)
    raw = np.asarray(values, dtype).view(b.key)
    magnitude = raw & b.key(b.abs)
    raw = np.where(magnitude == 0, b.key(0), raw)
    raw = np.where(magnitude > b.inf, b.key(b.nan), raw).astype(b.key)
    return np.where(raw >= b.sign, ~raw, raw | b.key(b.sign)).astype(b.key)


def fold32(x: jax.Array) -> jax.Array:
    """``uint32`` keys as they are; ``uint64`` keys with their high half xor-ed onto the low one, as ``uint32``."""
    if x.dtype == jnp.uint32:
        return x
    return (x ^ (x >> 32)).astype(jnp.uint32)


def mix32(x: jax.Array) -> jax.Array:
    """A bijective 32-bit mixer (Wellons' lowbias32): every input bit moves about half the output bits."""
    x = x.astype(jnp.uint32)
    x ^= x >> 16
    x *= jnp.uint32(0x7FEB352D)
    x ^= x >> 15
    x *= jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def mix64(x: jax.Array) -> jax.Array:
    """A bijective 64-bit mixer (SplitMix64's finalizer) of ``uint64`` keys."""
    x ^= x >> 30
    x *= jnp.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> 27
    x *= jnp.uint64(0x94D049BB133111EB)
    return x ^ (x >> 31)


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


def per_column(mask: jax.Array) -> jax.Array:
    """A mask of rows ``(mb,)`` as one broadcasting over columns ``(1, mb)``; a mask per column ``(d, mb)``
    (:func:`finite_cells`) as it is."""
    return mask if mask.ndim == 2 else mask[None, :]


def masked_columns(batch: jax.Array, mask: jax.Array) -> jax.Array:
    """:func:`columns`, the padding rows (``mask`` False) the filler, which sorts last; ``mask`` ``(mb,)``, or
    ``(d, mb)``: each column's own values (:func:`finite_cells`)."""
    keys = columns(batch)
    return jnp.where(per_column(mask), keys, fill(keys.dtype))


def finite_cells(x: jax.Array, keep: jax.Array) -> jax.Array:
    """What a sketch of a summary per column folds of the rows ``keep`` ``(mb,)`` of values ``x`` ``(mb,)`` or
    ``(mb, d)`` under ``nan_policy="omit"``: each float column's finite values ``(d, mb)``, a mask per column; ``keep``
    itself for integers (every value finite), so that their fold is the rows' as under "propagate"."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return keep
    return keep[None, :] & jnp.isfinite(x).reshape(x.shape[0], -1).T


def real_values(window: jax.Array) -> jax.Array:
    """Per column, the keys of a window of a float column's sorted keys ``(d, n)`` that are not the filler: its
    values folded under ``nan_policy="omit"``, the skipped NaN and Inf (and padding) the filler after them (no
    float's key is the filler, :func:`to_keys`)."""
    return jnp.sum(window != fill(window.dtype), axis=1, dtype=jnp.int32)


def sort_by_key(cols: jax.Array, mask: jax.Array, keys: jax.Array, num_keys: int, *more: jax.Array):
    """Every column of a micro-batch sorted by (group key, value), padding last: what the sketches'
    ``add_keyed`` fold key by key.

    Args:
      cols: keys by column ``(d, mb)`` (:func:`masked_columns`).
      mask: real rows ``(mb,)``; keys: their group keys, in ``[0, num_keys)`` where ``mask``.
      more: ``(d, mb)`` arrays carried along (a weight per row and column).

    Returns:
      ``(groups, cols, *more)``: the group keys in sorted order ``(mb,)`` (``num_keys`` for
      padding), the same in every column, and the arrays sorted.
    """
    groups = jnp.where(mask, keys, num_keys).astype(jnp.int32)
    out = jax.lax.sort((jnp.broadcast_to(groups, cols.shape), cols, *more), dimension=1, num_keys=2)
    return (jnp.sort(groups), *out[1:])  # out[0][0], but not from the columns: the same on every model device


def run_window(x: jax.Array, start: jax.Array, length: jax.Array, width: int) -> jax.Array:
    """``x[:, start:start + length]`` of ``(d, mb)`` at the front of ``width`` slots, the rest :func:`empty_slot`."""
    blank = empty_slot(x.dtype)
    padded = jnp.concatenate([x, jnp.full((x.shape[0], width), blank, x.dtype)], axis=1)
    window = jax.lax.dynamic_slice_in_dim(padded, start, width, axis=1)
    return jnp.where(jnp.arange(width) < length, window, blank)


def running_sum(x: jax.Array, axis: int = 1) -> jax.Array:
    """``jnp.cumsum(x, axis)`` of integers by ``lax.associative_scan``'s tree: the same sums (integers add
    exactly in any order), 2-4x faster on XLA:CPU, which runs ``cumsum`` as windowed reductions of 16."""
    return jax.lax.associative_scan(jnp.add, x, axis=axis)


def running_max(x: jax.Array, axis: int = 0) -> jax.Array:
    """``lax.cummax(x, axis)`` of integers by ``lax.associative_scan``'s tree: the same maxima (any order),
    faster on XLA:CPU for the same reason as :func:`running_sum`."""
    return jax.lax.associative_scan(jnp.maximum, x, axis=axis)


def running_min(x: jax.Array, axis: int = 0, reverse: bool = False) -> jax.Array:
    """``lax.cummin(x, axis, reverse)`` of integers by ``lax.associative_scan``'s tree, as :func:`running_max`."""
    return jax.lax.associative_scan(jnp.minimum, x, reverse=reverse, axis=axis)


def fold_groups(fold, acc, groups: jax.Array, num_keys: int, width: int):
    """``acc`` (a leading ``num_keys`` axis on every leaf) with each group ``g`` present in ``groups``
    (sorted, :func:`sort_by_key`) folded in place: ``acc[g] = fold(acc[g], start, length)`` for every
    chunk ``[start, start + length)`` of at most ``width`` of its rows, one after another.

    A loop over the chunks present, not over every key; ``width`` (the most rows one ``fold`` takes,
    its static size) keeps a key of few rows from paying for a whole micro-batch.
    """
    mb = groups.shape[0]
    pos = jnp.arange(mb, dtype=jnp.int32)
    real = groups < num_keys
    first = real & jnp.concatenate([jnp.ones((1,), bool), groups[1:] != groups[:-1]])
    run_start = running_max(jnp.where(first, pos, 0))
    chunk = real & ((pos - run_start) % width == 0)
    starts = jnp.nonzero(chunk, size=mb, fill_value=mb)[0].astype(jnp.int32)
    chunks, rows = jnp.sum(chunk, dtype=jnp.int32), jnp.sum(real, dtype=jnp.int32)

    def body(i, acc):
        start = starts[i]
        end = jnp.where(i + 1 < chunks, starts[jnp.minimum(i + 1, mb - 1)], rows)
        group = groups[start]
        one = fold(jax.tree.map(lambda x: x[group], acc), start, end - start)
        return jax.tree.map(lambda x, v: x.at[group].set(v), acc, one)

    return jax.lax.fori_loop(0, chunks, body, acc)


HASH_ROUNDS = 8  # first_rows' most rounds; a micro-batch left unresolved after them is sorted instead
HASH_SLOTS_LOG2 = 2  # first_rows' table: at least 4n slots for n rows (2n: 3 rounds in each of 30 Zipf(1.1)
# micro-batches of 16384 rows against 4096 slots; 4n: 2 in 21 of them, TopK's add 0.87-0.95x; 8n: 2 in 28)


def table_bits(n: int) -> int:
    """The bits of :func:`first_rows`' table for ``n`` rows a column: at least ``4n`` slots."""
    return max(int(np.ceil(np.log2(max(n, 2)))) + HASH_SLOTS_LOG2, 4)


def hash_fits(d: int, n: int) -> bool:
    """Whether :func:`first_rows` can take ``d`` columns of ``n`` rows: its tables side by side, ``d`` times
    ``2^table_bits(n)`` slots, indexed by int32 (from 2^31 slots, 8 GiB of them, a caller sorts instead)."""
    return d << table_bits(n) <= np.iinfo(np.int32).max


def round_hash(keys: jax.Array, r: jax.Array, bits: int) -> jax.Array:
    """Round ``r``'s slot of each key in a table of ``2^bits``: the top ``bits`` of a seeded mix of the
    whole key (64-bit keys mixed in 64 bits, so no two rounds share their collisions by construction)."""
    if keys.dtype == jnp.uint64:
        mixed = fold32(mix64(keys ^ (r.astype(jnp.uint64) + 1) * jnp.uint64(0x9E3779B97F4A7C15)))
    else:
        mixed = mix32(keys ^ (r.astype(jnp.uint32) + 1) * jnp.uint32(GOLDEN))
    return (mixed >> (32 - bits)).astype(jnp.int32)


def first_rows(keys: jax.Array, valid: jax.Array, rounds: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Per row of ``keys`` ``(d, n)``, the index of the first valid row of its column holding the same key,
    found by hashing instead of sorting; and whether every valid row was resolved within ``rounds``.

    Each round hashes the unresolved keys into a table of at least ``4n`` slots (a new seed a round),
    keeps the lowest row index in each slot (a scatter-min) and resolves the rows whose slot's owner holds
    their own key, compared whole: a hash collision costs a round, never merges two keys. Every row of a
    key lands in the same slot, so a key's rows resolve together, to its first row; the lowest unresolved
    row always owns its slot, so each round resolves at least one key. Unresolved and invalid rows: -1.
    ``rounds``: :data:`HASH_ROUNDS` unless given. Only where :func:`hash_fits`.
    """
    rounds = HASH_ROUNDS if rounds is None else rounds
    d, n = keys.shape
    if not hash_fits(d, n):
        raise ValueError(f"first_rows: {d} columns of {n} rows overflow its int32 table; check hash_fits first")
    bits = table_bits(n)
    size = 1 << bits
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (d, n)).reshape(-1)
    table_at, keys_at = (jnp.arange(d, dtype=jnp.int32)[:, None] * m for m in (size, n))
    flat_keys = keys.reshape(-1)

    def body(state):  # the columns' tables side by side in one flat table: 1-D scatter and gathers
        r, rep = state
        open_ = valid & (rep < 0)
        slot = jnp.where(open_, round_hash(keys, r, bits) + table_at, d * size)
        owner = jnp.full((d * size,), n, jnp.int32).at[slot.reshape(-1)].min(pos, mode="drop")
        mine = owner[jnp.minimum(slot, d * size - 1)]
        same = open_ & (flat_keys[jnp.minimum(mine, n - 1) + keys_at] == keys)
        return r + 1, jnp.where(same, mine, rep)

    def more(state):
        r, rep = state
        return (r < rounds) & jnp.any(valid & (rep < 0))

    start = (jnp.int32(0), jnp.where(valid, -1, -1).astype(jnp.int32))  # varying as keys are in shard_map
    _, rep = jax.lax.while_loop(more, body, start)
    return rep, ~jnp.any(valid & (rep < 0))
