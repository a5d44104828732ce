"""A checkpoint's digests and signature: the ``meta`` schema that holds them, and their checks.

Every checkpoint's ``meta`` item (:func:`checkpoint_meta`, the one schema) holds a 64-bit digest of
every partial (:func:`~sharded_scan.digest.array_digests`), a SHA-256 of every process's source
state and a SHA-256 of the meta itself; with the operator's key, an HMAC-SHA256 of that digest.
:func:`meta_problem` says why a meta cannot be trusted, :func:`leaf_problem` why read partials are
not the ones saved. The digests are checksums against accidents; only the key stops someone who can
write the directory from forging a checkpoint that passes them.
"""

from __future__ import annotations

from typing import Any

import jax

from sharded_scan.digest import array_digests, json_digest, keyed_digest, same_digest

PyTree = Any

FORMAT = 2  # meta with digests
DIGESTS = ("digest", "partials_digests", "source_digest")  # a meta without any of them is refused


def checkpoint_meta(
    cursor: int, steps: int, fingerprint: dict[str, Any], shape: dict[str, Any],
    partials_digests: list[str], source_digest: str, key: bytes | None = None,
) -> dict[str, Any]:
    """The ``meta`` item of a checkpoint: the one schema, written by
    :meth:`~sharded_scan.checkpoint.CheckpointSession.save`.

    ``shape`` is how the partials are laid out (``{"shards": S, "axes": {...}}``: shard
    count and the mesh's non-``data`` axes; a compact save's ``{"shards": 1, "axes": {...},
    "compact": N}``: one merged state, each leaf flat, padded to a multiple of the N devices
    that wrote it); devices and processes are informational.
    ``digest`` covers every other field, and with a ``key``, ``hmac`` signs ``digest``
    (:func:`meta_problem` checks both).
    """
    meta = {
        "format": FORMAT,
        "cursor": int(cursor),
        "steps": int(steps),
        "fingerprint": fingerprint,
        "shards": int(shape["shards"]),
        "axes": dict(shape["axes"]),
        **({"compact": int(shape["compact"])} if shape.get("compact") else {}),
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "partials_digests": list(partials_digests),
        "source_digest": source_digest,
    }
    meta["digest"] = json_digest(meta)
    return meta if key is None else {**meta, "hmac": keyed_digest(key, meta["digest"])}


def meta_problem(meta: Any, key: bytes | None = None) -> str | None:
    """Why a checkpoint's ``meta`` cannot be trusted (a phrase), or None.

    Its digest fields must be there (a meta without them would turn the checks off) and match;
    with a ``key``, its ``hmac`` must verify (a checkpoint forged by someone without the key).
    """
    if not isinstance(meta, dict) or not {"cursor", "steps", "shards", "fingerprint"} <= set(meta):
        return "meta lacks cursor, steps, shards or fingerprint"
    missing = [name for name in DIGESTS if not isinstance(meta.get(name), list if name == "partials_digests" else str)]
    if missing:
        return f"its meta lacks the digest field{'s' * (len(missing) > 1)} {', '.join(missing)} (removed, or damaged)"
    if json_digest({k: v for k, v in meta.items() if k not in ("digest", "hmac")}) != meta["digest"]:
        return "its meta does not match its digest"
    if key is not None and not isinstance(meta.get("hmac"), str):
        return "its meta has no HMAC although a checkpoint key is set (written without the key, or the HMAC removed)"
    if key is not None and not same_digest(meta["hmac"], keyed_digest(key, meta["digest"])):
        return "its meta's HMAC does not verify under the checkpoint key (written with another key, or forged)"
    return None


def leaf_problem(digests: list[str], meta: dict[str, Any]) -> str | None:
    """Whether the partials' digests match the ones saved in ``meta``."""
    saved = meta["partials_digests"]
    bad = [i for i, (a, b) in enumerate(zip(digests, saved, strict=False)) if a != b]
    if bad or len(digests) != len(saved):
        return f"its partials do not match their digests (leaf {bad[0] if bad else len(saved)})"
    return None


def partials_problem(partials: PyTree, meta: dict[str, Any]) -> str | None:
    """Whether restored ``partials`` match the digests saved in ``meta`` (one reduction over every process's shards)."""
    return leaf_problem(array_digests(partials), meta)
