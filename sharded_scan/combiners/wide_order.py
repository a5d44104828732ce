"""Order on :class:`~sharded_scan.combiners.wide.Wide` integers: maxima, exactly, on the device.

A normalised Wide (lower limbs in ``[0, 2^16)``, the top limb signed) orders like the
tuple of its limbs from the top down, so a maximum is taken limb by limb: the largest
top limb, then among those the largest next limb, and so on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sharded_scan.combiners.wide import Wide

_LOWEST = jnp.iinfo(jnp.int32).min


def masked_max(w: Wide, mask: jax.Array) -> Wide:
    """The largest of ``w``'s values where ``mask`` holds, along its last value axis.

    ``w``: limbs ``(..., n, L)``, normalised; ``mask``: ``(..., n)``. Where no entry is
    masked in, the result is zero.
    """
    limbs = w.limbs
    keep = mask
    out = []
    for k in reversed(range(limbs.shape[-1])):
        limb = limbs[..., k]
        best = jnp.max(jnp.where(keep, limb, _LOWEST), axis=-1)
        keep = keep & (limb == best[..., None])
        out.append(jnp.where(jnp.any(mask, axis=-1), best, 0))
    return Wide(jnp.stack(out[::-1], axis=-1))


def maximum(a: Wide, b: Wide) -> Wide:
    """The elementwise maximum of two normalised Wide arrays of the same shape."""
    both = Wide(jnp.stack([a.limbs, b.limbs], axis=-2))
    return masked_max(both, jnp.ones(both.limbs.shape[:-1], bool))
