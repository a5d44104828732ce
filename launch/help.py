"""``--help``: the launcher's own flags and every field of the job's config, each with its default
and a one-line meaning; JAX's flags are left to ``--helpfull``.

The meanings come from where each field is defined: the run options and checkpoint fields from
the ``Attributes:`` of :class:`sharded_scan.RunOptions` and :class:`sharded_scan.CheckpointOptions`,
the combiner's arguments from its docstring's ``Args:``/``Attributes:``, the ``data`` fields
from ``launch.data.DATA_FIELDS``, the rest from ``configs.common.FIELD_HELP``.
"""

from __future__ import annotations

import inspect
import re
import textwrap
from typing import Any

from absl import flags

import sharded_scan
from configs.common import FIELD_HELP
from launch.config_args import shipped_configs
from launch.data import DATA_FIELDS, builtin_combiners, imported
from sharded_scan import options

USAGE = "usage: sharded-scan --config=NAME[:quick] --workdir=DIR [--config.FIELD=VALUE ...]   (python -m launch.main)"
_SECTION = re.compile(r"^\s*(Args|Arguments|Attributes|Parameters):\s*$")
_ENTRY = re.compile(r"^(\s*)(\w+)(?:\s*\([^)]*\))?:\s*(.*)$")


def argument_docs(obj: Any) -> dict[str, str]:
    """``{name: first sentence}`` from the ``Args:``/``Attributes:`` sections of ``obj``'s
    Google-style docstring (a class's own, then its ``__init__``'s)."""
    docs: dict[str, str] = {}
    init = obj.__init__ if isinstance(obj, type) and obj.__init__ is not object.__init__ else None
    for doc in (inspect.getdoc(obj), inspect.getdoc(init) if init is not None else None):
        found: dict[str, str] = {}
        in_section, entry_indent, name = False, None, None
        for line in (doc or "").splitlines():
            indent = len(line) - len(line.lstrip())
            if _SECTION.match(line):
                in_section, entry_indent, name = True, None, None
                continue
            entry = _ENTRY.match(line)
            if not in_section or not line.strip():
                in_section = False
            elif entry and entry_indent in (None, indent):
                entry_indent, name = indent, entry.group(2)
                found[name] = entry.group(3)
            elif name is not None and indent > entry_indent:
                found[name] += " " + line.strip()
            else:
                in_section = False
        for key, text in found.items():
            docs.setdefault(key, _first_sentence(text))
    return docs


def _first_sentence(text: str) -> str:
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", " ".join(text.split()))  # :class:`~a.B` -> a.B
    text = re.sub(r'``"([^`]*)"``', r'"\1"', text).replace("``", "'")
    end = re.search(r"\.(\s|$)", text)
    return text[: end.start() + 1] if end else text


def combiner_factory(name: str) -> Any:
    """The class or function ``combiner.name`` names, or None when it cannot be imported."""
    if ":" not in name:
        return getattr(sharded_scan, name, None)
    try:
        return imported(name, "config.combiner.name")
    except sharded_scan.UsageError:
        return None


def combiner_fields(combiner: Any) -> list[tuple[str, Any, str]]:
    """``(field, default, meaning)`` of the combiner section: its name and every argument it takes."""
    factory = combiner_factory(combiner.name)
    kwargs = dict(combiner.get("kwargs") or {})
    rows = [("combiner.name", combiner.name, f"the combiner: one of {', '.join(builtin_combiners())}, or "
             "package.module:Name (your Combiner class or a function returning one)")]
    docs = argument_docs(factory) if factory is not None else {}
    try:
        params = inspect.signature(factory).parameters if factory is not None else {}
    except (TypeError, ValueError):
        params = {}
    inner = combiner.get("inner")  # GroupBy's combiner per key: its own section
    for name, p in params.items():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or (name == "inner" and inner is not None):
            continue
        default = kwargs.pop(name, "(required)" if p.default is p.empty else p.default)
        rows.append((f"combiner.kwargs.{name}", default, docs.get(name, "")))
    rows += [(f"combiner.kwargs.{name}", value, "") for name, value in kwargs.items()]
    if inner is not None:
        rows += [(f"combiner.inner.{field.partition('.')[2]}", value, meaning)
                 for field, value, meaning in combiner_fields(inner)]
    return rows


def _meaning(path: str) -> str:
    section, _, name = path.rpartition(".")
    if section == "data":
        return DATA_FIELDS.get(name, "")
    if path in FIELD_HELP:
        return FIELD_HELP[path]
    owner = {"": sharded_scan.RunOptions, "checkpoint": sharded_scan.CheckpointOptions}.get(section)
    return argument_docs(owner).get(name, "") if owner is not None else ""


def config_fields(config: Any) -> list[tuple[str, Any, str]]:
    """``(field, default, meaning)`` of every field of ``config``: the combiner and its arguments,
    the data, the run options, then the rest (checkpointing, logging) as the config lists them."""
    plain = config.to_dict()
    data = plain.get("data", {})
    rows = combiner_fields(config.combiner)
    rows += [(f"data.{name}", data[name], _meaning(f"data.{name}")) for name in dict.fromkeys([*DATA_FIELDS, *data])
             if name in data]
    top = [*options.config_fields(), *plain]
    for key in dict.fromkeys(k for k in top if k in plain and k not in ("combiner", "data")):
        value = plain[key]
        if isinstance(value, dict):
            rows += [(f"{key}.{name}", inner, _meaning(f"{key}.{name}")) for name, inner in value.items()]
        else:
            rows.append((key, value, _meaning(key)))
    return rows


def _format(rows: list[tuple[str, Any, str]], width: int = 100) -> str:
    out = []
    for field, default, meaning in rows:
        head = f"  --config.{field}={default!r}" if default != "(required)" else f"  --config.{field} (required)"
        out.append(head)
        if meaning:
            out += textwrap.wrap(meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out)


def flag_lines(holders: list[Any], width: int = 100) -> str:
    """absl flags (their ``FlagHolder``s) as ``--name=default`` and their help, wrapped."""
    out = []
    for holder in sorted(holders, key=lambda h: h.name):
        flag = flags.FLAGS[holder.name]
        default = "" if flag.default is None else f"={flag.default_as_str.strip(chr(39))}"
        out.append(f"  --{holder.name}{default}")
        out += textwrap.wrap(flag.help, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out)


def help_text(flags_text: str, config: Any = None, config_name: str = "") -> str:
    """The whole ``--help``: usage, the launcher's flags, the config's fields (of ``config``, or
    the shipped configs and the fields every one has), and where JAX's flags are."""
    parts = [USAGE, "", "Runs one job and writes DIR/result.npz, result.json (and result.csv for a per-column result), "
             "summary.json and checkpoints/; rerunning resumes, or says 'already done'; 'sharded-scan show DIR' "
             "prints the result as a table.", "", "flags:", flags_text, ""]
    if config is None:
        shipped = "\n".join(f"  {name:16s} {doc}" for name, doc in shipped_configs().items())
        parts += [f"shipped configs (--config=NAME, or NAME:quick for a tiny run):\n{shipped}", ""]
        parts += ["Add --config=NAME to --help to list that job's fields: its combiner's arguments, the data, "
                  "the run options and checkpointing, with their defaults.", ""]
    else:
        parts += [f"config fields of --config={config_name} (--config.FIELD=VALUE; values are read as Python "
                  "literals):", _format(config_fields(config)), ""]
    parts += ["JAX's own flags (--jax_num_cpu_devices=8, --jax_platforms=cpu, --jax_enable_x64, ...) and absl's: "
              "--helpfull."]
    return "\n".join(parts)
