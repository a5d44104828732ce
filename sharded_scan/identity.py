"""A job's identity: its fingerprint, the digest that names it, and how two differ.

The fingerprint (:func:`job_fingerprint`) is what a checkpoint must match to be
resumed: the combiner and its parameters, the data (kind, row count, row spec), the
micro-batch, the accumulator's leaf dtypes and shapes, the user code in the combiner
(:func:`code_digests`) and the size and modification time of every file read (with
``CheckpointOptions(verify_data="digest")`` also the SHA-256 of its bytes,
:func:`with_contents`). It leaves out the mesh, so a checkpoint resumes on another mesh. :func:`job_digest` names
the job in a lease and in a workdir's ``summary.json``; :func:`job_difference` and
:func:`files_difference` word why a saved fingerprint is not this job's.

A ``from_fn`` body, a ``Gradient`` loss or a user's own Combiner class is code, not a
parameter: editing it changes the answer while every parameter stays the same. Their
digests go into the fingerprint, so a checkpoint written by the old code is refused
instead of silently resumed. A function's digest covers its bytecode, constants and the
names it uses, its defaults, the values it closes over (arrays by their bytes) and,
recursively, the functions of the same module it calls; not its line numbers, so moving
it in its file changes nothing. Code of sharded_scan, JAX and numpy is left out: it is
the library, not the job.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import sys
import types
from typing import Any

import jax
import numpy as np

from sharded_scan.digest import json_digest, stream_digest
from sharded_scan.errors import UsageError
from sharded_scan.paths import as_path

LIBRARIES = ("sharded_scan", "jax", "jaxlib", "numpy", "builtins", "functools")
_DEPTH = 6


def _ours(module: str | None) -> bool:
    return not module or module.split(".")[0] not in LIBRARIES


def _value(value: Any, seen: set[int]) -> str:
    """A stable rendering of a closed-over or default value (never a memory address)."""
    if isinstance(value, (bool, int, float, complex, str, bytes, type(None))):
        return repr(value)
    if isinstance(value, (np.ndarray, np.generic)) or type(value).__module__.startswith("jax"):
        try:
            array = np.asarray(value)
            return f"{array.dtype}{array.shape}:{hashlib.sha256(array.tobytes()).hexdigest()[:16]}"
        except (TypeError, ValueError):
            return type(value).__name__
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_value(v, seen) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_value(v, seen)}" for k, v in sorted(value.items(), key=repr)) + "}"
    if callable(value):
        return function_digest(value, seen) or getattr(value, "__qualname__", type(value).__name__)
    return type(value).__qualname__


def _code(code: types.CodeType) -> str:
    consts = []
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            consts.append(_code(c))
        elif isinstance(c, frozenset):
            consts.append(repr(sorted(c, key=repr)))
        else:
            consts.append(repr(c))
    return hashlib.sha256(repr((code.co_code, consts, code.co_names, code.co_argcount)).encode()).hexdigest()


def function_digest(fn: Any, seen: set[int] | None = None) -> str | None:
    """The digest of a user function's code (None for library code and non-functions)."""
    seen = set() if seen is None else seen
    if isinstance(fn, functools.partial):
        inner = function_digest(fn.func, seen) or ""
        return hashlib.sha256(repr((inner, _value(fn.args, seen), _value(fn.keywords, seen))).encode()).hexdigest()
    fn = inspect.unwrap(fn) if callable(fn) else fn
    if not isinstance(fn, types.FunctionType) or not _ours(fn.__module__) or id(fn) in seen or len(seen) > 64:
        return None
    seen.add(id(fn))
    parts = [_code(fn.__code__), _value(fn.__defaults__, seen), _value(fn.__kwdefaults__, seen)]
    for cell in fn.__closure__ or ():
        try:
            parts.append(_value(cell.cell_contents, seen))
        except ValueError:  # an empty cell
            parts.append("<empty>")
    for name in fn.__code__.co_names:  # functions of the same module it calls
        called = fn.__globals__.get(name)
        if isinstance(called, types.FunctionType) and called.__module__ == fn.__module__:
            parts.append(f"{name}:{function_digest(called, seen)}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def class_digest(cls: type) -> str:
    """The digest of the methods a user's class (and its user bases) define."""
    parts = []
    for klass in cls.__mro__:
        if not _ours(klass.__module__):
            continue
        for name, member in sorted(vars(klass).items()):
            member = getattr(member, "__func__", member)
            parts.append(f"{klass.__qualname__}.{name}:{function_digest(member) or ''}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def code_digests(combiner: Any) -> dict[str, str]:
    """``{"<attribute path> <name>": digest}`` for the user code in ``combiner``.

    Walks the combiner's attributes (wrappers, inner combiners, lists and dicts of them)
    for user functions (``body gram_body``) and user combiner classes (``class MyStats``);
    empty for a built-in combiner with no user function.
    """
    found: dict[str, str] = {}

    def visit(obj: Any, path: str, depth: int) -> None:
        if depth > _DEPTH:
            return
        if isinstance(obj, (list, tuple, dict)):
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            for key, item in items:
                visit(item, f"{path}[{key}]", depth + 1)
        elif isinstance(obj, (types.FunctionType, functools.partial)) or hasattr(obj, "__wrapped__"):
            digest = function_digest(obj)
            if digest is not None:
                found[f"{path} {getattr(inspect.unwrap(obj), '__qualname__', 'partial')}".strip()] = digest
        elif hasattr(type(obj), "add") and hasattr(type(obj), "init"):  # a combiner, or a wrapper of one
            if _ours(type(obj).__module__):
                found[f"{path} class {type(obj).__qualname__}".strip()] = class_digest(type(obj))
            for name, item in vars(obj).items():
                visit(item, f"{path}.{name}" if path else name, depth + 1)

    visit(combiner, "", 0)
    return found


def describe_leaves(tree: Any) -> list[str]:
    """Each leaf as ``"path: dtype[shape]"``."""
    return [
        f"{jax.tree_util.keystr(path)}: {np.dtype(leaf.dtype).name}{list(leaf.shape)}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    ]


def job_fingerprint(job: Any, source: Any, microbatch: int) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: combiner, data, micro-batch, accumulator,
    the user code in the combiner (:func:`code_digests`) and the size and modification time
    of every file read (``files``: a change there may be overridden).

    Mesh-independent (the job, not its resolution for a mesh), so a checkpoint resumes
    on another mesh.

    Args:
      job: the combiner with the run's policies applied, before a mesh resolved it.
      source: the :class:`~sharded_scan.sources.Source` it reads.
      microbatch: the micro-batch it runs.
    """
    raw = {
        "combiner": job.fingerprint(),
        "data": source.describe(),
        "microbatch": int(microbatch),
        "accumulator": describe_leaves(jax.eval_shape(job.init, source.spec)),
        "code": code_digests(job),
        "files": source.stamps(),
    }
    return json.loads(json.dumps(raw, default=repr))  # tuples -> lists, as JSON gives them back


def job_digest(fingerprint: dict[str, Any]) -> str:
    """The digest that names the job of ``fingerprint`` (in a lease, a workdir's ``summary.json``)."""
    return json_digest(fingerprint)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, (dict, list)):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        out: dict[str, Any] = {}
        for key, value in items:
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out if out or not prefix else {prefix: tree}
    return {prefix: tree}


def fingerprint_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The first field where two fingerprints differ, as a phrase; None when equal."""
    old, new = _flat(saved), _flat(current)
    sections = list(dict.fromkeys([*current, *saved]))  # combiner, data, microbatch, accumulator, ...
    keys = list(dict.fromkeys([*new, *old]))
    for key in sorted(keys, key=lambda k: sections.index(k.split(".")[0])):
        if old.get(key, "<absent>") != new.get(key, "<absent>"):
            return f"{key} is {old.get(key, '<absent>')!r} there but {new.get(key, '<absent>')!r} here"
    return None


def processes_difference(terms: list[dict[str, Any]]) -> str | None:
    """The first field where the processes' ``terms`` (one dict each, in process order) differ,
    with each value and the processes that hold it, as a phrase; None when all are equal."""
    flats = [_flat(t) for t in terms]
    keys = list(dict.fromkeys(k for flat in flats for k in flat))
    differing = [k for k in keys if len({repr(flat.get(k, "<absent>")) for flat in flats}) > 1]
    if not differing:
        return None
    key, holders = differing[0], {}
    for i, flat in enumerate(flats):
        holders.setdefault(repr(flat.get(key, "<absent>")), []).append(i)
    groups = [f"process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))}: "
              f"{value if len(value) <= 120 else value[:117] + '...'}" for value, ids in holders.items()]
    more = {0: "", 1: "; 1 more field differs"}.get(len(differing) - 1, f"; {len(differing) - 1} more fields differ")
    return f"{key} differs ({', '.join(groups)}{more})"


# Fingerprint sections a checkpoint of an older format lacks: not compared when absent there.
NEWER_SECTIONS = ("code", "files")
MESH_FIELDS = ("model_shards",)  # the mesh's, not the job's (set by for_mesh); some older fingerprints lack them


def _without_mesh_fields(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _without_mesh_fields(v) for k, v in tree.items() if k not in MESH_FIELDS}
    return [_without_mesh_fields(v) for v in tree] if isinstance(tree, list) else tree


def job_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Why the ``saved`` fingerprint names another job than ``current`` (a phrase), or None.

    The files read are left out (:func:`files_difference`), and so are the sections an
    older ``saved`` lacks and the combiners' mesh fields (``model_shards``: a checkpoint
    written before a combiner split over ``model`` resumes).
    """
    saved, current = _without_mesh_fields(saved), _without_mesh_fields(current)
    saved = {k: v for k, v in saved.items() if k != "files"}
    current = {k: v for k, v in current.items() if k != "files" and (k in saved or k not in NEWER_SECTIONS)}
    diff = fingerprint_difference(saved, current)
    if diff is not None and diff.startswith("code."):
        return f"the code of {diff.split(' is ')[0][5:]} changed since (an edit, or another Python than " \
               f"{sys.version.split()[0]})"
    return diff


CONTENT = ", sha256 "  # what follows a file's stamp in ``files`` under verify_data="digest"


def with_contents(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """``fingerprint`` with the SHA-256 of every file it stamps added to that file's stamp
    (``"N bytes, modified T, sha256 H"``): a file rewritten with the same size and its time put
    back then differs too.

    Costs one read of every byte the job reads, here, before anything runs (through
    etils.epath, so a URL is downloaded once more). A directory's digest covers every file
    under it (by relative path and bytes), and a path under a listed directory is not read
    twice. A fingerprint that holds the digests already is returned as it is.
    """
    files = dict(fingerprint.get("files", {}))
    if not files or any(CONTENT in stamp for stamp in files.values()):
        return fingerprint
    folders = [p for p in files if as_path(p).is_dir()]
    for path, stamp in files.items():
        if any(path.startswith(folder.rstrip("/") + "/") for folder in folders):
            continue
        try:
            files[path] = f"{stamp}{CONTENT}{_content_digest(path)}"
        except OSError as e:
            raise UsageError(f"verify_data='digest' cannot read {path!r} to hash it ({e.strerror or e}); "
                             "use verify_data='stamps' for this data.") from None
    return {**fingerprint, "files": files}


def _content_digest(path: str) -> str:
    """SHA-256 of a file's bytes; of a directory, of its entries' names and digests."""
    root = as_path(path)
    if not root.is_dir():
        with root.open("rb") as f:
            return stream_digest(f)
    return json_digest([[p.name, _content_digest(str(p))] for p in sorted(root.iterdir(), key=lambda p: p.name)])


def _stamp_part(files: dict[str, str]) -> dict[str, str]:
    return {path: stamp.split(CONTENT)[0] for path, stamp in files.items()}


def files_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """Which file the job reads changed since ``saved`` (a phrase), or None (also when ``saved`` is of
    an older format, without ``files``). Files are compared by size and modification time, or, when
    both hold their digests (``verify_data="digest"``), by their bytes (a copy that lost its time is
    the same file); when only one of them holds digests (``verify_data`` changed), by their stamps."""
    if "files" not in saved:
        return None
    old, new = dict(saved["files"]), dict(current.get("files", {}))
    digests = [any(CONTENT in s for s in files.values()) for files in (old, new)]
    if digests[0] != digests[1]:
        old, new = _stamp_part(old), _stamp_part(new)
    for path in dict.fromkeys([*new, *old]):
        was, now = old.get(path, "<absent>"), new.get(path, "<absent>")
        if was == now or all(digests) and CONTENT in was and was.split(CONTENT)[1] == now.split(CONTENT)[-1]:
            continue
        if CONTENT in was and CONTENT in now and _stamp_part({path: was}) == _stamp_part({path: now}):
            return (f"{path} holds other bytes than then (SHA-256 {was.split(CONTENT)[1][:16]}... there, "
                    f"{now.split(CONTENT)[1][:16]}... here), though its size and modification time are the same")
        return f"{path} is {was!r} there but {now!r} here"
    return None
