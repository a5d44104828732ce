"""Turns a job config's ``data`` and ``combiner`` sections into library objects."""

from __future__ import annotations

import importlib
from typing import Any

import ml_collections

import sharded_scan
from sharded_scan import sources
from sharded_scan.errors import UsageError

KINDS = ("synthetic", "npy", "npy_shards", "zarr")


def data_config(num_rows: int, features: int, *, targets: bool = False, kind: str = "synthetic") -> Any:
    """The ``data`` section every config starts from: synthetic rows, no files needed."""
    return ml_collections.ConfigDict(
        {
            "kind": kind,  # one of KINDS
            "path": "",  # npy: a .npy file; npy_shards: a directory or glob; zarr: a zarr array
            "zarr_driver": "",  # zarr: "zarr" or "zarr3"; empty to detect
            # synthetic only:
            "num_rows": num_rows,
            "features": features,
            "dtype": "float32",
            "seed": 0,
            "distribution": "normal",
            "chunk_rows": 4096,
            "targets": targets,
            "noise": 0.1,
        }
    )


def _source_class(name: str) -> type:
    cls = getattr(sources, name, None)
    if cls is None:
        raise UsageError(f"this build of sharded_scan has no sources.{name}; update sharded_scan.")
    return cls


def make_source(data: Any) -> sources.Source:
    """The Source that ``data`` (a config's ``data`` section) describes.

    Raises:
      UsageError: an unknown kind, a missing path, or what the source itself rejects.
    """
    if data.kind not in KINDS:
        raise UsageError(f"config.data.kind must be one of {', '.join(KINDS)}; got {data.kind!r}.")
    if data.kind == "synthetic":
        return _source_class("SyntheticSource")(
            data.num_rows, data.features, dtype=data.dtype, seed=data.seed, kind=data.distribution,
            chunk_rows=data.chunk_rows, targets=data.targets, noise=data.noise,
        )
    if not data.path:
        raise UsageError(f"config.data.kind={data.kind!r} needs a file: pass --config.data.path=PATH.")
    if data.kind == "npy":
        return _source_class("NpySource")(data.path)
    if data.kind == "npy_shards":
        return _source_class("NpyShardsSource")(data.path)
    return _source_class("ZarrSource")(data.path, driver=data.zarr_driver or None)


def make_combiner(combiner: Any) -> sharded_scan.Combiner:
    """The combiner a config's ``combiner`` section names, built with its ``kwargs``.

    ``combiner.name`` is a name exported by ``sharded_scan`` (``"Gram"``,
    ``"Covariance"``, ...) or ``"module:function"`` for a factory such as a config's own.
    """
    name, kwargs = combiner.name, dict(combiner.get("kwargs", {}) or {})
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise UsageError(f"config.combiner.name={name!r} cannot be imported: {e}.") from None
    else:
        factory = getattr(sharded_scan, name, None)
        if not (isinstance(factory, type) and issubclass(factory, sharded_scan.Combiner)):
            raise UsageError(f"config.combiner.name={name!r} is not a combiner of this build of sharded_scan.")
    try:
        built = factory(**kwargs)
    except TypeError as e:
        raise UsageError(f"config.combiner {name} does not take these kwargs {sorted(kwargs)}: {e}.") from None
    if not isinstance(built, sharded_scan.Combiner):
        raise UsageError(f"config.combiner.name={name!r} did not build a sharded_scan Combiner.")
    return built
