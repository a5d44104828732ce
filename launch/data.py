"""Turns a job config into library objects: its ``data`` section, ``combiner`` section and run options."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import ml_collections

import sharded_scan
from sharded_scan import sources
from sharded_scan.errors import UsageError
from sharded_scan.options import RunOptions, config_fields


def _file(data: Any) -> str:
    if not data.path:
        raise UsageError(f"config.data.kind={data.kind!r} needs a file: pass --config.data.path=PATH.")
    return data.path


# One factory per ``config.data.kind``: each builds the Source from the ``data`` section.
SOURCES: dict[str, Callable[[Any], sources.Source]] = {
    "synthetic": lambda data: sources.SyntheticSource(
        data.num_rows, data.features, dtype=data.dtype, seed=data.seed, kind=data.distribution,
        chunk_rows=data.chunk_rows, targets=data.targets, noise=data.noise,
    ),
    "npy": lambda data: sources.NpySource(_file(data), zero_copy=data.zero_copy),
    "npy_shards": lambda data: sources.NpyShardsSource(_file(data), zero_copy=data.zero_copy),
    "zarr": lambda data: sources.ZarrSource(_file(data), driver=data.zarr_driver or None,
                                            fill_missing=data.zarr_fill_missing),
    "python": lambda data: _from_factory(data),
}
# Fields of the ``data`` section that only some kinds read: set for another kind, they
# would be ignored silently (a job on synthetic rows that meant to read a file).
ONLY_FOR = {
    "path": ("npy", "npy_shards", "zarr"),
    "zero_copy": ("npy", "npy_shards"),
    "zarr_driver": ("zarr",),
    "zarr_fill_missing": ("zarr",),
    "factory": ("python",),
    "factory_kwargs": ("python",),
}


def check_fields(data: Any) -> None:
    """Raises a one-line UsageError when a field is set that ``data.kind`` does not read."""
    for field, kinds in ONLY_FOR.items():
        value = data.get(field)
        if value and data.kind not in kinds:
            raise UsageError(
                f"config.data.{field}={value!r} is set but config.data.kind is {data.kind!r}, which does not read it; "
                f"pass --config.data.kind={kinds[0]} (kinds that read it: {', '.join(kinds)}), or drop "
                f"--config.data.{field}."
            )


def _from_factory(data: Any) -> sources.Source:
    """``data.factory`` (``"module:function"``) called with ``data.factory_kwargs``: a Source or arrays."""
    if ":" not in data.factory:
        raise UsageError(
            f"config.data.kind='python' needs --config.data.factory=module:function, got {data.factory!r}."
        )
    factory = imported(data.factory, "config.data.factory")
    kwargs = dict(data.factory_kwargs)
    try:
        built = factory(**kwargs)
    except TypeError as e:
        raise UsageError(f"config.data.factory {data.factory} does not take {sorted(kwargs)}: {e}.") from None
    return sources.as_source(built)


def imported(name: str, field: str) -> Any:
    """The object ``"module:attribute"`` names, or a one-line UsageError naming ``field``."""
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise UsageError(f"{field}={name!r} cannot be imported: {e}.") from None


def data_config(num_rows: int, features: int, *, targets: bool = False, kind: str = "synthetic") -> Any:
    """The ``data`` section every config starts from: synthetic rows, no files needed."""
    return ml_collections.ConfigDict(
        {
            "kind": kind,  # one of SOURCES
            "path": "",  # npy: a .npy file; npy_shards: a directory or glob; zarr: a zarr array
            "zero_copy": False,  # npy, npy_shards: rows as memory-map views (faster; a truncated file: bus error)
            "zarr_driver": "",  # zarr: "zarr" or "zarr3"; empty to detect
            "zarr_fill_missing": False,  # zarr: read chunks that are not stored as the fill value
            "factory": "",  # python: "module:function" returning a Source (e.g. an IteratorSource) or arrays
            "factory_kwargs": {},  # python: keyword arguments of the factory
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


def make_source(data: Any) -> sources.Source:
    """The Source that ``data`` (a config's ``data`` section) describes.

    Raises:
      UsageError: an unknown kind, a missing path, a field this kind does not read, or
        what the source itself rejects.
    """
    factory = SOURCES.get(data.kind)
    if factory is None:
        raise UsageError(f"config.data.kind must be one of {', '.join(SOURCES)}; got {data.kind!r}.")
    check_fields(data)
    return factory(data)


def run_options(config: Any, **extra: Any) -> RunOptions:
    """The :class:`RunOptions` a job config's plain option fields give, with ``extra`` (checkpoint, progress...)."""
    return RunOptions.make(**{name: config[name] for name in config_fields()}, **extra)


def make_combiner(combiner: Any) -> sharded_scan.Combiner:
    """The combiner a config's ``combiner`` section names, built with its ``kwargs``.

    ``combiner.name`` is a name exported by ``sharded_scan`` (``"Gram"``,
    ``"Covariance"``, ...) or ``"module:function"`` for a factory such as a config's own.
    """
    name, kwargs = combiner.name, dict(combiner.get("kwargs", {}) or {})
    if ":" in name:
        factory = imported(name, "config.combiner.name")
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
