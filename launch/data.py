"""Turns a job config into library objects: its ``data`` section, ``combiner`` section and run options."""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
import numpy as np

import sharded_scan
from sharded_scan import sources
from sharded_scan.errors import UsageError
from sharded_scan.options import RunOptions, config_fields


def _file(data: Any) -> str:
    if not data.path:
        raise UsageError(f"config.data.kind={data.kind!r} needs a file: pass --config.data.path=PATH.")
    return data.path


def _array_files(data: Any, path: str) -> sources.Source:
    """One array of ``npy``, ``npy_shards`` or ``zarr`` files."""
    if data.kind == "zarr":
        return sources.ZarrSource(path, driver=data.zarr_driver or None, fill_missing=data.zarr_fill_missing)
    kind = sources.NpySource if data.kind == "npy" else sources.NpyShardsSource
    return kind(path, zero_copy=data.zero_copy)


def _arrays(data: Any) -> sources.Source:
    """X from ``data.path``; ``(X, y)`` when ``data.target_path`` names y's file(s) too."""
    x = _array_files(data, _file(data))
    return sources.TreeSource((x, _array_files(data, data.target_path))) if data.target_path else x


def _columns(data: Any) -> Any:
    """The ``columns=`` of a tabular source: ``data.columns`` (comma-separated; empty for every
    numeric column not named elsewhere), as ``(X, y)`` when ``data.target`` names y's column, inside
    ``(weights, ...)`` when ``data.weight`` names a column, inside ``(keys, ...)`` when ``data.key`` does."""
    names = [n.strip() for n in data.columns.split(",") if n.strip()] or None
    for field in ("target", "weight", "key"):
        if names is not None and data[field] and data[field] in names:
            raise UsageError(f"config.data.{field}={data[field]!r} is also in config.data.columns; list only X's "
                             "there.")
    columns = (names, data.target) if data.target else names
    if data.weight:  # the rows of Weighted, which make_combiner builds
        columns = (data.weight, columns)
    return (data.key, columns) if data.key else columns  # the rows of GroupBy


# The first bytes of the binary files a tabular kind may be pointed at.
MAGIC = {b"PAR1": "a Parquet file", b"ARROW1": "an Arrow file", b"FEA1": "a Feather file", b"\x93NUMPY": "a .npy file"}


def check_tabular_file(kind: str, path: str) -> None:
    """Raises a one-line UsageError when the local file ``path`` is missing, or plainly not of
    ``kind`` (``parquet`` or ``csv``), before the reader prints its bytes into the terminal."""
    if "://" in path or any(c in path for c in "*?["):
        return  # a URL or a glob: the source says what it finds
    if not os.path.exists(path):
        raise UsageError(f"config.data.path={path!r}: no such file or directory; check the path.")
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        head = f.read(4096)
    found = next((what for magic, what in MAGIC.items() if head.startswith(magic)), None)
    if kind == "csv" and (found or b"\0" in head):
        fix = "--config.data.kind=parquet" if found in ("a Parquet file", "an Arrow file", "a Feather file") else (
            "--config.data.kind=npy" if found else "the path of a CSV file")
        raise UsageError(f"config.data.path={path!r} is {found or 'a binary file'}, not CSV "
                         f"(config.data.kind='csv'); pass {fix}.")
    if kind == "parquet" and not found and head and b"\0" not in head:
        raise UsageError(f"config.data.path={path!r} is text (a CSV file?), not Parquet or Arrow "
                         "(config.data.kind='parquet'); pass --config.data.kind=csv for a CSV file.")


def _tabular(data: Any) -> sources.Source:
    check_tabular_file(data.kind, _file(data))
    kind = sources.ParquetSource if data.kind == "parquet" else sources.CsvSource

    def read(columns: Any, dtype: Any) -> sources.Source:
        return kind(_file(data), columns=columns, dtype=dtype, strings=data.strings or "hash")

    if not data.key:
        return read(_columns(data), data.dtype or None)
    # The rows as GroupBy(by=key) reads them: the keys in a source of their own, in their own type (one source reads
    # one dtype; a string column as ids, which GroupBy turns into its strings); the rest as a None resolves beside
    # them (every numeric column but the keys and weights), no warning about the key column a None leaves out.
    return read(_columns(data)[1], data.dtype or None).grouped_by(data.key)


ZIPF_EXPONENT = 1.1  # synthetic keys: key k is drawn about (k + 1) ** -1.1 as often as key 0


class ZipfKeys(sources.Source):
    """Keys ``0..num_keys-1`` with Zipf frequencies, drawn per block of ``chunk_rows`` rows from
    ``(seed, block)``: the same keys however the rows are cut (the synthetic kind's ``data.key``)."""

    def __init__(self, num_rows: int, num_keys: int, seed: int = 0, chunk_rows: int = 4096):
        self._num_rows, self._num_keys, self._seed, self._chunk_rows = num_rows, num_keys, seed, chunk_rows
        self.num_keys = num_keys
        weights = np.arange(1, num_keys + 1, dtype=np.float64) ** -ZIPF_EXPONENT
        self._cumulative = np.cumsum(weights / weights.sum())

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def spec(self) -> Any:
        return jax.ShapeDtypeStruct((), np.int32)

    def read(self, start: int, stop: int) -> np.ndarray:
        blocks = [np.zeros(0, np.int32)]
        for b in range(start // self._chunk_rows, -(-stop // self._chunk_rows)):
            lo, hi = start - b * self._chunk_rows, stop - b * self._chunk_rows
            uniform = np.random.default_rng([self._seed, b, 1]).random(self._chunk_rows)
            keys = np.minimum(np.searchsorted(self._cumulative, uniform, side="right"), self._num_keys - 1)
            blocks.append(keys[max(lo, 0) : hi].astype(np.int32))
        return np.concatenate(blocks)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "num_keys": self._num_keys, "seed": self._seed, "chunk_rows": self._chunk_rows}


def synthetic_key_count(data: Any) -> int | None:
    """``K`` of the synthetic kind's keys, ``data.key='zipf:K'``; None when unset."""
    if not data.key:
        return None
    kind, _, count = data.key.partition(":")
    if kind != "zipf" or not count.isdigit() or int(count) < 1:
        raise UsageError(f"config.data.key={data.key!r}: synthetic keys read 'zipf:K' (K keys, 0..K-1, with Zipf "
                         "frequencies), e.g. --config.data.key=zipf:1000.")
    return int(count)


def synthetic_keys(data: Any) -> sources.Source | None:
    """The synthetic kind's keys, ``data.key='zipf:K'``: :class:`ZipfKeys` below ``K``; None when unset."""
    count = synthetic_key_count(data)
    return None if count is None else ZipfKeys(data.num_rows, count, data.seed, data.chunk_rows)


def _synthetic(data: Any) -> sources.Source:
    rows = sources.SyntheticSource(
        data.num_rows, data.features, dtype=data.dtype or "float32", seed=data.seed, kind=data.distribution,
        chunk_rows=data.chunk_rows, targets=data.targets, noise=data.noise,
    )
    keys = synthetic_keys(data)
    return rows if keys is None else sources.TreeSource((keys, rows))


# One factory per ``config.data.kind``: each builds the Source from the ``data`` section.
SOURCES: dict[str, Callable[[Any], sources.Source]] = {
    "synthetic": _synthetic,
    "npy": _arrays,
    "npy_shards": _arrays,
    "zarr": _arrays,
    "parquet": _tabular,
    "csv": _tabular,
    "python": lambda data: _from_factory(data),
}
FILE_KINDS = ("npy", "npy_shards", "zarr", "parquet", "csv")
# Fields of the ``data`` section that only some kinds read: set for another kind, they
# would be ignored silently (a job on synthetic rows that meant to read a file).
ONLY_FOR = {
    "path": FILE_KINDS,
    "target_path": ("npy", "npy_shards", "zarr"),
    "columns": ("parquet", "csv"),
    "target": ("parquet", "csv"),
    "key": ("parquet", "csv", "synthetic"),
    "weight": ("parquet", "csv"),
    "dtype": ("synthetic", "parquet", "csv"),
    "strings": ("parquet", "csv"),
    "zero_copy": ("npy", "npy_shards"),
    "zarr_driver": ("zarr",),
    "zarr_fill_missing": ("zarr",),
    "factory": ("python",),
    "factory_kwargs": ("python",),
}


def check_fields(data: Any) -> None:
    """Raises a one-line UsageError when a field is set that ``data.kind`` does not read, or when
    the job wants ``(X, y)`` (``data.targets``) and a file kind is not told where y is."""
    if data.targets and data.kind in FILE_KINDS and not (data.get("target") or data.get("target_path")):
        where = "--config.data.target=COLUMN" if data.kind in ("parquet", "csv") else "--config.data.target_path=Y"
        raise UsageError(
            f"this job fits y on X, and config.data.kind={data.kind!r} reads only X from {data.path or 'its path'}; "
            f"pass {where} (y's {'column' if 'COLUMN' in where else 'file(s)'})."
        )
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
    check_kwargs(factory, kwargs, f"config.data.factory {data.factory}", "data.factory_kwargs")
    try:
        built = factory(**kwargs)
    except TypeError as e:
        raise UsageError(f"config.data.factory {data.factory} does not take {sorted(kwargs)}: {e}.") from None
    return sources.as_source(built)


def imported(name: str, field: str) -> Any:
    """The object ``"module:attribute"`` names, or a one-line UsageError naming ``field``."""
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise UsageError(f"{field}={name!r} must read package.module:Name.")
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise UsageError(
            f"{field}={name!r}: cannot import {module!r} ({e}); is it installed or on PYTHONPATH?"
        ) from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise UsageError(f"{field}={name!r}: importing {module!r} failed: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(found, part):
            raise UsageError(f"{field}={name!r}: {module!r} has no {attr!r}.") from None
        found = getattr(found, part)
    return found


# What each field of the ``data`` section means: ``--help`` prints it beside the field's default.
DATA_FIELDS = {
    "kind": f"where rows come from: {', '.join(SOURCES)}",
    "path": "npy: a .npy file; npy_shards: a directory or glob of them; zarr: an array; parquet: a file, "
            "directory or glob of Parquet/Arrow files; csv: a CSV file with a header row",
    "target_path": "npy, npy_shards, zarr: y's file(s), read as (X, y) with X from path",
    "columns": "parquet, csv: X's columns, comma-separated; empty for every numeric one",
    "target": "parquet, csv: y's column: rows are (X, y)",
    "key": "parquet, csv: the keys' column (strings, integers...; grouped by value, at most "
            "combiner.kwargs.max_keys of them; integers 0..N-1 with combiner.kwargs.num_keys=N): rows are (keys, X), "
            "reduced per key by combiner.name=GroupBy; synthetic: 'zipf:K' draws keys 0..K-1 with Zipf frequencies",
    "weight": "parquet, csv: the weights' column (>= 0; 0 omits a row): rows are (weights, X), reduced by "
               "Weighted(combiner), per key GroupBy(Weighted(combiner.inner))",
    "dtype": "synthetic: float32 when empty; parquet, csv: the columns' own type when empty (e.g. float32)",
    "strings": "parquet, csv: 'hash' (when empty) reads string columns as int64 ids (TopK, DistinctCount); 'refuse'",
    "zero_copy": "npy, npy_shards: rows as memory-map views (faster; a truncated file: bus error)",
    "zarr_driver": "zarr: 'zarr' or 'zarr3'; empty to detect",
    "zarr_fill_missing": "zarr: read chunks that are not stored as the fill value",
    "factory": "python: 'module:function' returning a Source (e.g. an IteratorSource) or arrays",
    "factory_kwargs": "python: keyword arguments of the factory (--config.data.factory_kwargs.NAME=VALUE)",
    "targets": "the job wants (X, y): synthetic makes y; file kinds need target or target_path",
    "num_rows": "synthetic: rows",
    "features": "synthetic: columns of X",
    "seed": "synthetic: the random seed",
    "distribution": "synthetic: 'normal' or 'uniform'",
    "chunk_rows": "synthetic: rows generated per chunk (the same rows whatever the device count)",
    "noise": "synthetic with targets: the standard deviation of y's noise",
}


def data_config(num_rows: int, features: int, *, targets: bool = False, kind: str = "synthetic") -> Any:
    """The ``data`` section every config starts from: synthetic rows, no files needed (fields: ``DATA_FIELDS``)."""
    return ml_collections.ConfigDict(
        {
            "kind": kind,
            "path": "",
            "target_path": "",
            "columns": "",
            "target": "",
            "key": "",
            "weight": "",
            "dtype": "",
            "strings": "",
            "zero_copy": False,
            "zarr_driver": "",
            "zarr_fill_missing": False,
            "factory": "",
            "factory_kwargs": {},
            "targets": targets,
            "num_rows": num_rows,
            "features": features,
            "seed": 0,
            "distribution": "normal",
            "chunk_rows": 4096,
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


def make_combiner(combiner: Any, data: Any = None) -> sharded_scan.Combiner:
    """The combiner a config's ``combiner`` section names, built with its ``kwargs``.

    ``combiner.name`` is a name exported by ``sharded_scan`` (``"Gram"``,
    ``"Covariance"``, ...) or ``"package.module:Name"`` for your own: a Combiner class or
    a function returning a Combiner (a config's own factory, a ``from_fn`` job). A ``GroupBy``
    takes its ``inner`` combiner from the section ``combiner.inner`` (a ``name`` and ``kwargs``).
    With ``data`` (the config's ``data`` section) naming a ``weight`` column, the combiner that reads
    the rows is wrapped in ``Weighted`` (a GroupBy's inner one).

    Raises:
      UsageError: the name cannot be imported, is not a Combiner, or refuses the kwargs.
    """
    weighted = data is not None and bool(data.get("weight"))
    if combiner.get("inner") is not None:
        inner = make_combiner(combiner.inner)
        kwargs = {name: value for name, value in dict(combiner.get("kwargs", {}) or {}).items() if value is not None}
        dense = data is not None and data.kind == "synthetic" and data.get("key")
        if dense and not {"num_keys", "max_keys"} & kwargs.keys():  # synthetic keys 0..K-1: num_keys K
            kwargs["num_keys"] = synthetic_key_count(data)
        return _built(combiner.name, {**kwargs, "inner": sharded_scan.Weighted(inner) if weighted else inner})
    if data is not None and data.get("key"):
        raise UsageError(f"config.data.key={data.key!r} makes rows (keys, X), which config.combiner.name="
                         f"{combiner.name!r} does not read; pass --config.combiner.name=GroupBy with "
                         "config.combiner.inner naming the combiner per key (see configs/groupby.py).")
    built = _built(combiner.name, dict(combiner.get("kwargs", {}) or {}))
    return sharded_scan.Weighted(built) if weighted else built


def _built(name: str, kwargs: dict[str, Any]) -> sharded_scan.Combiner:
    """The combiner ``name`` built with ``kwargs`` (:func:`make_combiner`)."""
    if ":" in name:
        factory = imported(name, "config.combiner.name")
    else:
        factory = getattr(sharded_scan, name, None)
        if not (isinstance(factory, type) and issubclass(factory, sharded_scan.Combiner)):
            raise UsageError(
                f"config.combiner.name={name!r} is not a combiner of sharded_scan (its own: "
                f"{', '.join(builtin_combiners())}); name your own as package.module:Class."
            )
    if isinstance(factory, type) and not issubclass(factory, sharded_scan.Combiner):
        raise UsageError(f"config.combiner.name={name!r} is a class but not a sharded_scan.Combiner; subclass "
                         "sharded_scan.Combiner (or AdditiveCombiner).")
    if not callable(factory):
        raise UsageError(f"config.combiner.name={name!r} is a {type(factory).__name__}, not a Combiner class or "
                         "a function returning one.")
    check_kwargs(factory, kwargs, f"config.combiner {name}")
    try:
        built = factory(**kwargs)
    except (TypeError, ValueError) as e:
        raise UsageError(f"config.combiner {name} refused its kwargs {kwargs}: {e}") from None
    if not isinstance(built, sharded_scan.Combiner):
        raise UsageError(f"config.combiner.name={name!r} built a {type(built).__name__}, not a sharded_scan "
                         "Combiner.")
    return built


def builtin_combiners() -> list[str]:
    """The Combiner classes ``sharded_scan`` exports, by name."""
    return sorted(n for n in sharded_scan.__all__ if isinstance(getattr(sharded_scan, n), type)
                  and issubclass(getattr(sharded_scan, n), sharded_scan.Combiner)
                  and n not in ("Combiner", "AdditiveCombiner"))


def check_kwargs(factory: Callable, kwargs: dict[str, Any], what: str, field: str = "combiner.kwargs") -> None:
    """Raises a one-line UsageError naming the arguments ``factory`` takes when ``kwargs`` has others."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to check against: the call itself will say
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    takes = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(kwargs) - set(takes))
    if unknown:
        raise UsageError(
            f"{what} takes no argument {', '.join(map(repr, unknown))}; it takes: {', '.join(takes) or 'none'} "
            f"(--config.{field}.NAME=VALUE)."
        )
