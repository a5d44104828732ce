"""The launcher's command line before absl reads it: which config file, and combiner arguments;
and what absl or a config file raise while reading it, as one line (:func:`command_line_error`).

``--config=gram`` (or ``gram:quick``) names a config shipped in the ``configs`` package, so
it works from any directory once sharded_scan is installed; ``--config=configs/gram.py``
works from anywhere too when no such file is in the working directory. A path to your own
config file is used as it is.

``--config.combiner.kwargs.NAME=VALUE`` (and ``--config.data.factory_kwargs.NAME=VALUE``)
may name any argument of the combiner (or factory), also one the config file does not
list: they are taken off the command line here, their values read as Python literals
(``2``, ``0.5``, ``(0.1, 0.9)``, ``True``; anything else is a string), and merged into the
config after it is loaded. One of two alternative arguments (``Quantiles``' ``num_buckets`` for
its ``qs``) replaces the config's other.
"""

from __future__ import annotations

import ast
import os
import re
from typing import Any

from absl import flags

import configs
from sharded_scan.errors import UsageError
from sharded_scan.workdir import one_line

CONFIG_DIR = os.path.dirname(os.path.abspath(configs.__file__))
NOT_JOBS = ("__init__", "common")  # modules of the configs package that are not job configs
DICT_FIELDS = ("combiner.kwargs", "data.factory_kwargs")  # config dicts whose keys the command line adds
# Arguments of a built-in that name the same thing in two ways (the combiner takes one of them): one
# given on the command line replaces the config's other, so --config.combiner.kwargs.num_buckets=10 works alone.
ALTERNATIVES = {"Quantiles": (("qs", "num_buckets"),)}


def shipped_configs() -> dict[str, str]:
    """The job configs shipped with sharded_scan: name -> the first line of its docstring."""
    found = {}
    for name in sorted(os.listdir(CONFIG_DIR)):
        stem, ext = os.path.splitext(name)
        if ext != ".py" or stem in NOT_JOBS:
            continue
        with open(os.path.join(CONFIG_DIR, name), encoding="utf-8") as f:
            found[stem] = _first_doc_line(f.read())
    return found


def _first_doc_line(text: str) -> str:
    try:
        doc = ast.get_docstring(ast.parse(text)) or ""
    except SyntaxError:
        return ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def resolve_config(value: str) -> str:
    """The config file ``--config=value`` means, keeping its ``:ARG``.

    Raises:
      UsageError: a bare name that is not a shipped config.
    """
    path, sep, arg = value.partition(":")
    if os.path.exists(path):
        return value
    stem = os.path.splitext(os.path.basename(path))[0]
    shipped = os.path.join(CONFIG_DIR, stem + ".py")
    is_shipped = stem not in NOT_JOBS and os.path.isfile(shipped)
    if "/" not in path and os.sep not in path and not path.endswith(".py"):  # a bare name
        if not is_shipped:
            raise UsageError(
                f"--config={value!r}: no such config file, and no shipped config named {stem!r}; the shipped "
                f"ones are: {', '.join(shipped_configs())} (--list_configs says what each does)."
            )
        return shipped + sep + arg
    if is_shipped and os.path.dirname(path) in ("configs", os.path.join(".", "configs")):
        return shipped + sep + arg  # the README's configs/NAME.py, from any directory
    return value


def literal(text: str) -> Any:
    """A command-line value read as a Python literal, or the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


def split_args(argv: list[str]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """``argv`` with ``--config`` resolved and the dict-field overrides taken out.

    Returns:
      ``(argv for absl, {"combiner.kwargs": {NAME: value}, "data.factory_kwargs": {...}})``.

    Raises:
      UsageError: a dict-field override without ``=VALUE``, or an unknown bare config name.
    """
    rest, extra = [], {field: {} for field in DICT_FIELDS}
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if flag in ("--config", "-config") and eq:
            rest.append(f"{flag}={resolve_config(value)}")
            continue
        field = next((f for f in DICT_FIELDS if flag.startswith(f"--config.{f}.")), None)
        if field is None:
            rest.append(arg)
            continue
        name = flag[len(f"--config.{field}."):]
        if not eq or not name.isidentifier():
            raise UsageError(f"write {field} arguments as --config.{field}.NAME=VALUE; got {arg!r}.")
        extra[field][name] = literal(value)
    return rest, extra


def merge_extra(config: Any, extra: dict[str, dict[str, Any]]) -> None:
    """Merges the dict-field overrides of :func:`split_args` into the loaded ``config``."""
    for field, values in extra.items():
        if not values:
            continue
        section, key = field.split(".")
        merged = {**dict(config[section].get(key) or {}), **values}
        if field == "combiner.kwargs":
            for group in ALTERNATIVES.get(config.combiner.name, ()):
                given = [name for name in group if name in values]
                merged = {k: v for k, v in merged.items() if not (given and k in group and k not in given)}
        with config.unlocked():
            config[section][key] = merged


def command_line_error(e: BaseException) -> str:
    """One line for what absl or the config file raised while reading the command line."""
    if isinstance(e, UsageError):
        return str(e)
    if isinstance(e, flags.Error):
        return one_line(e)
    if isinstance(e, (KeyError, AttributeError)):  # a locked config refuses an unknown field
        return not_a_field(e)
    if isinstance(e, SyntaxError):  # the config file does not parse
        return f"bad --config: {e.filename}, line {e.lineno}: {type(e).__name__}: {e.msg}"
    return f"bad --config: {one_line(e)}"


def not_a_field(e: BaseException) -> str:
    """One readable line for an override of a field the config does not have."""
    inner = e.args[0] if e.args and isinstance(e.args[0], BaseException) else e
    text = str(inner.args[0] if inner.args else inner)
    name = re.search(r'Key "([^"]+)"', text) or re.match(r"""\W*([\w.]+)""", text)
    suggestion = re.search(r'Did you mean "([^"]+)"', text)
    hint = (f'; did you mean "{suggestion.group(1)}"?' if suggestion
            else "; check the spelling (--print_config lists them).")
    return f"bad --config override: {(name.group(1) if name else text)!r} is not a field of this config{hint}"
