"""Compiled steps kept by the job: a fresh process runs a job it ran before without tracing or lowering it.

JAX's persistent compilation cache (:mod:`sharded_scan.compile_cache`) is keyed by the lowered program, so a
warm process still builds, traces and lowers the step before it finds it there (a 200,000-row ``Describe``:
about 0.8 CPU-s, against 0.1 to load the executable alone). This cache keys the step's executable by the job
instead: :func:`key` of everything the traced program depends on, and :func:`load` / :func:`store` an entry
(the executable serialized by ``jax.experimental.serialize_executable``, and beside it the memory estimate's
figures, which trace the step too: :func:`~sharded_scan.admission.memory_estimate`).

It is safe or it is off, never a wrong program:

- the key is the whole of what the program depends on: the combiner as it runs (its class and, recursively, what
  its equality compares, which by the project's contract covers everything that changes its programs, the
  process's memo of programs keys on it too: :func:`canonical`; anything it cannot spell exactly, a user's
  function or class, an object of another library, a class with an equality of its own: no key, the step is
  traced as before), the arguments' shapes, dtypes, shardings and tree, the
  layout of a step, the precision, the mesh's axes and devices, the process count and index, every JAX option,
  ``XLA_FLAGS`` and the other ``XLA_*``/``LIBTPU*``/``TPU_*`` variables, the backend and its version, the CPU's
  model and instruction set, the versions of Python, JAX, jaxlib, numpy and ml_dtypes, and a digest of this
  library's own source files (so an edited checkout keys anew). The entry holds the key in full and is used only
  where it is equal, byte for byte;
- an entry that is damaged, truncated, of another format, or fails to load is ignored, logged, and replaced;
- writers write a temporary file and rename it (several processes at once: the last complete one stays);
- at most :data:`MAX_ENTRIES` entries: the least recently stored or loaded go;
- it is on only where JAX's cache is on, in a local directory: ``sharded_scan_executables/`` inside it (JAX
  keeps its own entries as ``*-cache`` files beside); ``SHARDED_SCAN_EXECUTABLE_CACHE=0`` turns it off alone.

What it cannot see: a process that patches the library's code or constants at run time (tests do) runs what it
patched only where it traces; such a process sets ``SHARDED_SCAN_EXECUTABLE_CACHE=0`` (``tests/conftest.py``).
Like JAX's, the cache is trusted: loading an entry runs code of whoever could write the directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import platform
import sys
import tempfile
import threading
import types
from typing import Any, NamedTuple

import jax
import numpy as np

from sharded_scan import compile_cache

FORMAT = 1
MAGIC = b"sharded_scan executable\n"
ENV = "SHARDED_SCAN_EXECUTABLE_CACHE"
SUBDIRECTORY = "sharded_scan_executables"
MAX_ENTRIES = 256  # about 0.6 MB each (a Describe of 8 columns): the least recently used go past it
_PACKAGE = "sharded_scan"
# JAX's options that say where and whether programs are cached or logged, not what they compute.
_CACHE_OPTIONS = frozenset({
    "jax_compilation_cache_dir", "jax_enable_compilation_cache", "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size", "jax_raise_persistent_cache_errors",
    "jax_log_compiles", "jax_explain_cache_misses", "jax_logging_level", "jax_debug_log_modules",
    "jax_pprint_use_color", "jax_traceback_filtering", "jax_persistent_cache_enable_xla_caches",
})
_ENV_PREFIXES = ("XLA_", "LIBTPU", "TPU_")
# Classes of other libraries an attribute may name by module and name: their code is versioned in the key.
_VERSIONED = ("numpy", "jax", "jaxlib", "ml_dtypes", "builtins")
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_counts = {"looked_up": 0, "loaded": 0, "stored": 0}


class UnkeyableError(Exception):
    """Something in a job this cache cannot spell exactly: the job has no key (it is traced)."""


class Entry(NamedTuple):
    """An entry read and checked: the memory estimate's figures and the executable's serialized bytes."""

    figures: tuple[int, ...]
    payload: bytes


class Counts(NamedTuple):
    """This process's steps looked up by key, loaded from an entry (neither traced nor compiled), and stored."""

    looked_up: int
    loaded: int
    stored: int


def counts() -> Counts:
    """The process's :class:`Counts` so far (subtract two to count a run's)."""
    with _lock:
        return Counts(**_counts)


def _count(name: str) -> None:
    with _lock:
        _counts[name] += 1


def directory() -> str | None:
    """Where entries are kept: ``sharded_scan_executables/`` in JAX's cache directory; None where JAX's cache is
    off, is not a local directory, or ``SHARDED_SCAN_EXECUTABLE_CACHE=0``."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    jax_dir = compile_cache.in_use()
    if not jax_dir or ("://" in jax_dir and not jax_dir.startswith("file://")):
        return None
    return os.path.join(jax_dir.removeprefix("file://"), SUBDIRECTORY)


def canonical(obj: Any, depth: int = 0) -> Any:
    """``obj`` spelled exactly as JSON: what a compiled program may depend on in a combiner.

    Numbers exactly (floats by their hex), strings, tuples and lists, dicts, enums, numpy dtypes and arrays (their
    bytes' SHA-256), and objects of this library's classes by class and what their equality compares
    (recursively, :func:`_attributes`); functions
    and classes of this library by module and name (their code is in the source digest), classes of numpy, JAX and
    ml_dtypes by module and name (versioned in the key).

    Raises:
      UnkeyableError: anything else (a user's function or class, a lambda, another library's object), or too deep.
    """
    if depth > 24:
        raise UnkeyableError("too deep")
    if isinstance(obj, enum.Enum):  # before str: an enum of str
        if not (_ours(type(obj)) or type(obj).__module__.split(".")[0] in _VERSIONED):
            raise UnkeyableError(f"the enum {type(obj).__qualname__}")
        return {"enum": _name(type(obj)), "name": obj.name}
    if obj is None or type(obj) in (bool, str):
        return obj
    if type(obj) is int:
        return {"int": str(obj)}
    if type(obj) is float:
        return {"float": obj.hex()}
    if type(obj) is complex:
        return {"complex": [obj.real.hex(), obj.imag.hex()]}
    if isinstance(obj, bytes):
        return {"bytes": obj.hex()}
    if isinstance(obj, np.dtype):
        return {"dtype": obj.str, "name": obj.name}
    if isinstance(obj, (np.ndarray, np.generic)):
        array = np.asarray(obj)
        if array.dtype.hasobject:
            raise UnkeyableError("an array of objects")
        return {"array": array.dtype.str, "shape": list(array.shape),
                "sha256": hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()}
    if isinstance(obj, (tuple, list)) and type(obj) in (tuple, list):
        return {type(obj).__name__: [canonical(x, depth + 1) for x in obj]}
    if isinstance(obj, (frozenset, set)) and type(obj) in (frozenset, set):
        return {"set": sorted((canonical(x, depth + 1) for x in obj), key=lambda c: json.dumps(c, sort_keys=True))}
    if type(obj) is dict:
        return {"dict": sorted(([canonical(k, depth + 1), canonical(v, depth + 1)] for k, v in obj.items()),
                               key=lambda kv: json.dumps(kv, sort_keys=True))}
    if isinstance(obj, type):
        if _ours(obj) or obj.__module__.split(".")[0] in _VERSIONED:
            return {"class": _name(obj)}
        raise UnkeyableError(f"the class {obj.__qualname__}")
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):
        if _ours(obj) and "<lambda>" not in obj.__qualname__:
            return {"function": _name(obj)}
        raise UnkeyableError(f"the function {getattr(obj, '__qualname__', obj)}")
    cls = type(obj)
    if not _ours(cls):
        raise UnkeyableError(f"a {cls.__qualname__} of {cls.__module__}")
    if isinstance(obj, tuple):
        if not hasattr(cls, "_fields"):
            raise UnkeyableError(f"a {cls.__qualname__}, a tuple")
        attributes = dict(zip(cls._fields, obj, strict=True))  # a NamedTuple of ours
    else:
        attributes = _attributes(obj)
    return {"object": _name(cls), "attributes": {name: canonical(value, depth + 1)
                                                 for name, value in sorted(attributes.items())}}


def _attributes(obj: Any) -> dict[str, Any]:
    """What an object of ours is, as its equality compares it: a dataclass's compared fields (the project's
    contract, which the process's memo of programs keys on too: a combiner's equality covers everything that changes
    its compiled programs, and leaves out only what the host alone reads, such as ``Quantiles.qs``, and operands);
    another object's ``__dict__`` (less what its ``cached_property``s derived) and slots.

    Raises:
      UnkeyableError: a class with an equality of its own (operands among its attributes, their values in
        neither the program nor its equality: ``Histogram``'s range, the exact quantiles' boundaries).
    """
    cls = type(obj)
    for klass in cls.__mro__:
        if klass is object:
            break
        own = "__eq__" in vars(klass) and not (dataclasses.is_dataclass(klass) and klass.__dataclass_params__.eq)
        if own:
            raise UnkeyableError(f"{cls.__qualname__}, whose equality is its own")
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.compare}
    derived = {name for klass in cls.__mro__ for name, member in vars(klass).items()
               if isinstance(member, functools.cached_property)}
    attributes = {name: value for name, value in getattr(obj, "__dict__", {}).items() if name not in derived}
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                attributes[name] = getattr(obj, name)
    return attributes


def _ours(thing: Any) -> bool:
    """Defined at the top level of a module of this library (a class or function made in a function may close over
    values its name does not say)."""
    return ((getattr(thing, "__module__", None) or "").split(".")[0] == _PACKAGE
            and "<locals>" not in getattr(thing, "__qualname__", "<locals>"))


def _name(thing: Any) -> str:
    return f"{thing.__module__}.{thing.__qualname__}"


def abstract(tree: Any) -> Any:
    """Arguments (``jax.ShapeDtypeStruct`` leaves): their tree, shapes, dtypes, weak types and shardings (a leaf's
    sharding by its spec, memory kind and mesh), as JSON."""
    leaves, treedef = jax.tree.flatten(tree)
    spelled = []
    for leaf in leaves:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            raise UnkeyableError(f"an argument {type(leaf).__name__}")
        spelled.append({"shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).str, "weak": bool(leaf.weak_type),
                        "sharding": None if leaf.sharding is None else _sharding(leaf.sharding)})
    return {"tree": str(treedef), "leaves": spelled}


def _sharding(sharding: Any) -> Any:
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        raise UnkeyableError(f"a {type(sharding).__name__}")
    mesh_digest = hashlib.sha256(json.dumps(mesh_terms(mesh), sort_keys=True).encode()).hexdigest()
    return {"spec": repr(spec), "memory_kind": sharding.memory_kind, "mesh": mesh_digest}


def mesh_terms(mesh: Any) -> dict:
    """A mesh as JSON: its axes, their sizes and types, and its devices in order (id, kind, process, platform)."""
    devices = [[int(d.id), str(d.device_kind), int(d.process_index), str(d.platform)] for d in mesh.devices.flat]
    return {"axes": list(mesh.axis_names), "shape": [int(n) for n in mesh.devices.shape],
            "types": [str(t) for t in getattr(mesh, "axis_types", ())], "devices": devices}


@functools.cache
def source_digest() -> str:
    """SHA-256 of this library's ``.py`` files (paths and bytes), read once a process."""
    root = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                digest.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


@functools.cache
def _machine() -> dict:
    cpu = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU part"):
                    cpu.setdefault(name, value.strip())
    except OSError:
        pass
    if "flags" not in cpu and "Features" not in cpu:  # no instruction set read: the machine itself, by name
        cpu["node"] = platform.node()
    import jaxlib  # noqa: PLC0415 - its version only
    import ml_dtypes  # noqa: PLC0415 - its version only
    return {"python": sys.version, "machine": platform.machine(), "processor": platform.processor(), "cpu": cpu,
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "numpy": np.__version__,
            "ml_dtypes": ml_dtypes.__version__, "library": source_digest()}


def environment() -> dict:
    """What every program of the process depends on besides its job: the machine, the versions, the library's
    source, the backend, the processes, JAX's options (as this thread sees them) and XLA's variables."""
    backend = jax.devices()[0].client
    options = {}
    for name, value in sorted(jax.config.values.items()):
        if name not in _CACHE_OPTIONS:
            value = getattr(jax.config, name) if hasattr(jax.config, name) else value  # this thread's setting
            options[name] = value if isinstance(value, (bool, str, type(None))) else repr(value)
            if " at 0x" in str(options[name]):  # an object's address: not a value another process can match
                raise UnkeyableError(f"JAX's option {name}")
    return {"machine": _machine(), "platform": backend.platform, "platform_version": backend.platform_version,
            "processes": [jax.process_count(), jax.process_index()], "device_count": jax.device_count(),
            "options": options, "variables": _variables()}


@functools.cache
def _variables() -> dict:
    """XLA's variables as the backend read them: once, after it started (``XLA_FLAGS`` set later changes nothing)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}


def key(terms: dict) -> str | None:
    """The key text of a program of ``terms`` (JSON: the job's part, with :func:`environment`); None where this
    cache is off."""
    if directory() is None or jax.process_count() > 1:  # several processes: JAX's cache alone (not tried here)
        return None
    return json.dumps({"format": FORMAT, "job": terms, "environment": environment()}, sort_keys=True,
                      separators=(",", ":"))


def _path(key_text: str) -> str:
    return os.path.join(directory() or "", hashlib.sha256(key_text.encode()).hexdigest() + ".exe")


def load(key_text: str) -> Entry | None:
    """The entry of ``key_text``, checked (its format, its whole key, its bytes' digest); None where there is none
    or it is damaged (logged: the next store replaces it)."""
    _count("looked_up")
    path = _path(key_text)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        if not data.startswith(MAGIC):
            raise ValueError("not an entry")
        header_end = data.index(b"\n", len(MAGIC))
        header = json.loads(data[len(MAGIC):header_end])
        body = data[header_end + 1:]
        if header["format"] != FORMAT or len(body) != header["bytes"]:
            raise ValueError("another format, or truncated")
        if hashlib.sha256(body).hexdigest() != header["sha256"]:
            raise ValueError("its bytes do not match their digest")
        key_bytes = header["key_bytes"]
        if body[:key_bytes].decode() != key_text:
            raise ValueError("another job's key")
        entry = Entry(tuple(int(x) for x in header["figures"]), body[key_bytes:])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        _log.info("ignored the damaged executable %s (%s); it is replaced.", path, error)
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # used now: the last the bound on entries sets aside (:func:`_evict`)
    return entry


# XLA:CPU's LAPACK calls (QR, Cholesky, triangular solves, eigh: LinearRegression's and PCA's steps) are custom
# calls to targets named so; their kernels are scipy's LAPACK, which jaxlib binds only when it lowers such a call.
LAPACK_TARGET = b"lapack_"


def _bind_lapack() -> None:
    """Binds jaxlib's LAPACK kernels as lowering a LAPACK call does: a process that loads a step holding one
    without having lowered any ran it through unbound kernels (a segmentation fault at the first step). Only
    where needed: it imports scipy's LAPACK (about 0.4 s)."""
    try:
        from jaxlib import lapack  # noqa: PLC0415 - only where an entry holds a LAPACK call

        lapack._lapack.initialize()  # what jax._src.lax.linalg's lowerings call (lapack.prepare_lapack_call)
    except (ImportError, AttributeError):  # another jaxlib: lowering one such call binds them all
        import jax.numpy as jnp  # noqa: PLC0415

        jax.jit(jnp.linalg.cholesky).lower(np.eye(2, dtype=np.float32))


def executable(entry: Entry, devices: Any = None) -> jax.stages.Compiled | None:
    """The entry's executable loaded (on ``devices``: the mesh's, in order); None where it fails to load
    (logged)."""
    from jax.experimental import serialize_executable  # noqa: PLC0415 - only where an entry is loaded

    try:
        serialized, in_tree, out_tree = pickle.loads(entry.payload)  # noqa: S301 - the cache is trusted, as JAX's
        if LAPACK_TARGET in serialized:
            _bind_lapack()
        loaded = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                           execution_devices=devices)
    except Exception as error:  # noqa: BLE001 - a damaged or foreign entry is ignored, never a crash
        _log.info("ignored an executable that did not load (%s: %s); it is replaced.", type(error).__name__, error)
        return None
    _count("loaded")
    compile_cache.note_loaded()
    return loaded


@contextlib.contextmanager
def not_in_jax_cache():
    """What compiles in this thread meanwhile is not written to JAX's persistent cache (it is still looked up
    there): the step the job-keyed cache keeps (:func:`store`) is then serialized and written once, not twice
    (0.04 CPU-s of a 200,000-row ``Describe``'s cold run). JAX's thread-local setting of its write threshold
    (``jax_persistent_cache_min_compile_time_secs``, never in a key); where this JAX has none, nothing changes."""
    try:
        from jax._src import config as jax_config
        state = jax_config.persistent_cache_min_compile_time_secs
    except (ImportError, AttributeError):
        state = None
    if not callable(state):
        yield
        return
    with state(float("inf")):
        yield


def store(key_text: str, compiled: jax.stages.Compiled, figures: tuple[int, ...]) -> None:
    """Writes ``compiled`` under ``key_text`` with the memory estimate's ``figures``: a temporary file renamed into
    place. A program holding host callbacks or effects (as JAX's own cache keeps none), one that cannot be
    serialized, or a directory that cannot be written, stores nothing (logged)."""
    from jax.experimental import serialize_executable  # noqa: PLC0415 - only where an entry is written

    path = _path(key_text)
    unloaded = getattr(getattr(compiled, "_executable", None), "_unloaded_executable", None)
    held = [name for name in ("host_callbacks", "keepalive", "ordered_effects", "unordered_effects")
            if unloaded is None or getattr(unloaded, name, None)]
    if held:  # a callback is this process's Python object: another process would call what is not there
        _log.info("did not keep the step's executable: it holds %s.", ", ".join(held))
        return
    try:
        payload = io.BytesIO()
        pickle.dump(serialize_executable.serialize(compiled), payload, protocol=pickle.HIGHEST_PROTOCOL)
        key_bytes = key_text.encode()
        body = key_bytes + payload.getvalue()
        header = json.dumps({"format": FORMAT, "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest(),
                             "key_bytes": len(key_bytes), "figures": [int(x) for x in figures]})
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".exe")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + header.encode() + b"\n" + body)
            os.chmod(temporary, 0o644)  # as JAX's own entries: mkstemp's are the owner's alone
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except Exception as error:  # noqa: BLE001 - the cache is an optimization: a failed write changes no result
        _log.info("did not keep the step's executable in %s (%s: %s).", path, type(error).__name__, error)
        return
    _count("stored")
    _evict(os.path.dirname(path))


def _evict(folder: str) -> None:
    """Keeps at most :data:`MAX_ENTRIES` entries in ``folder``: the least recently used go (a reader that has one
    open still reads it whole; one that finds it gone compiles)."""
    try:
        entries = [e for e in os.scandir(folder) if e.name.endswith(".exe") and not e.name.startswith(".")]
        if len(entries) <= MAX_ENTRIES:
            return
        entries.sort(key=lambda e: e.stat().st_mtime)
        for e in entries[:len(entries) - MAX_ENTRIES]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(e.path)
    except OSError as error:
        _log.info("did not bound the entries in %s (%s).", folder, error)

