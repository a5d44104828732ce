r"""Prints a finished job's result as a table: ``sharded-scan show WORKDIR`` (``python -m launch.show WORKDIR``).

    $ sharded-scan show /tmp/describe
    /tmp/describe: Describe of 1000 rows
       count  nan_count       mean       std  ...
    0   1000          0  0.0123685  0.996541  ...

The table is ``result.csv``'s (:func:`launch.outputs.column_table`): one row per column of the data, wrapped
into blocks that fit the terminal as pandas prints a wide frame (a ``GroupBy`` result: each key's table, the first
:data:`MAX_KEYS`); then the fields of one value (``count``, ``r2``) and any other array (quantile levels, bin
edges, a Gram matrix) by name. It reads ``result.npz`` and
``summary.json`` only, never the data, and needs no JAX device. A workdir that holds no finished result (no
``summary.json``, a missing or damaged ``result.npz``) is one ``error:`` line, status 2.
"""

from __future__ import annotations

import json
import shutil
import sys
from typing import Any

import numpy as np

from launch.outputs import STATE, column_table
from sharded_scan.errors import UsageError
from sharded_scan.paths import as_path
from sharded_scan.workdir import CHECKPOINTS, EXIT_USAGE, RESULT, RESULT_DIGEST, SUMMARY, load_result, result_digest

USAGE = "usage: sharded-scan show WORKDIR   (python -m launch.show WORKDIR): prints the finished job's result"
GAP = 2  # spaces between the table's columns
MAX_KEYS = 20  # the GroupBy keys whose tables are printed


def show_text(workdir: str, width: int = 80) -> str:
    """The result in ``workdir`` as text at most ``width`` characters wide (but for one cell wider than that).

    Raises:
      UsageError: ``workdir`` holds no finished result.
    """
    summary = finished_summary(workdir)
    arrays = {name: a for name, a in load_result(workdir).items() if STATE not in name.split(".")}
    combiner = ((summary.get("config") or {}).get("combiner") or {}).get("name")
    lines = [f"{as_path(workdir)}: {f'{combiner} of ' if combiner else ''}{summary.get('rows')} rows"]
    scalars: dict[str, Any] = {}
    shown: set[str] = set()
    prefixes = [name[: -len("columns")] for name in arrays if name == "columns" or name.endswith(".columns")]
    for prefix in prefixes:  # a pytree of results (Describe of (X, y)): each part's table, under its name
        parent = prefix[:-1].rpartition(".")[0]
        keys = arrays.get(f"{parent}.keys".lstrip("."))
        if keys is not None:  # GroupBy: the inner result's table of each key
            shown |= by_key(arrays, prefix, keys, arrays.get(f"{parent}.rows".lstrip(".")), width, lines)
            continue
        table = column_table(arrays, prefix)
        if table is None:
            continue
        lines += ["", *([f"{prefix[:-1]}:"] if prefix else []), *table_lines(table.index, table.header, table.rows,
                                                                              width)]
        scalars.update((prefix + label, value) for label, value in table.scalars.items())
        shown |= {prefix + name for name in table.fields}
    for name, array in arrays.items():
        if name in shown:
            continue
        if np.ndim(array) == 0:
            scalars[name] = array.item()
        else:
            lines += ["", f"{name}:", *array_lines(np.asarray(array), width)]
    if scalars:
        pad = max(len(label) for label in scalars) + GAP
        lines += [""] + [f"{label:<{pad}}{cell(value)}".rstrip() for label, value in scalars.items()]
    return "\n".join(lines)


def by_key(arrays: dict[str, Any], prefix: str, keys: Any, rows: Any, width: int, lines: list[str]) -> set[str]:
    """Appends to ``lines`` the table of each key of a ``GroupBy`` result (its inner result's arrays under
    ``prefix``, each with a leading axis of one entry per key), the first :data:`MAX_KEYS` of them; returns the
    names shown."""
    inner = {name[len(prefix):]: np.asarray(a) for name, a in arrays.items()
             if name.startswith(prefix) and "." not in name[len(prefix):]}
    columns = inner.pop("columns")
    keys = np.asarray(keys)
    if any(a.ndim == 0 or a.shape[0] != len(keys) for a in inner.values()):
        return set()
    shown: set[str] = set()
    for i, key in enumerate(keys.tolist()[:MAX_KEYS]):
        table = column_table({**{name: a[i] for name, a in inner.items()}, "columns": columns})
        if table is None:
            return set()
        held = f" ({int(np.asarray(rows)[i])} rows)" if rows is not None else ""
        one = "".join(f", {label} {cell(v)}" for label, v in table.scalars.items())
        lines += ["", f"key {cell(key)}{held}{one}:", *table_lines(table.index, table.header, table.rows, width)]
        shown |= {prefix + name for name in table.fields}
    if len(keys) > MAX_KEYS:
        lines += ["", f"... and {len(keys) - MAX_KEYS} more keys ({RESULT} holds every one)"]
    return shown | {prefix + "columns"}


def finished_summary(workdir: str) -> dict[str, Any]:
    """``summary.json`` of a workdir whose ``result.npz`` is the one it was written with.

    Raises:
      UsageError: no such directory, no summary (a job not finished, or not a workdir), or a result missing or
        damaged since.
    """
    root = as_path(workdir)
    if not root.is_dir():
        raise UsageError(f"{root} is not a directory: pass the --workdir of a job.")
    try:
        summary = json.loads((root / SUMMARY).read_text())
    except FileNotFoundError:
        started = (root / CHECKPOINTS).is_dir()
        state = ("its job has not finished (it holds checkpoints: rerun the job's command to resume it)" if started
                 else "no job has finished there")
        raise UsageError(f"{root} holds no finished result: no {SUMMARY}, {state}.") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"{root / SUMMARY} cannot be read ({e}): rerun the job's command to write it again.") from None
    if not isinstance(summary, dict) or result_digest(workdir) != summary.get(RESULT_DIGEST):
        raise UsageError(f"{root / RESULT} is missing or not the file {SUMMARY} was written with: rerun the job's "
                         "command to write it again from its final checkpoint.")
    return summary


def cell(value: Any) -> str:
    """One value as the table prints it: floats to 6 significant digits (``NaN``, ``inf``), text with what a
    terminal would act on escaped (``\\r``, ``\\x1b``, a trailing ``\\x00``)."""
    if isinstance(value, str):
        return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in value)
    if isinstance(value, bool | np.bool_):
        return str(bool(value))
    if isinstance(value, float | np.floating):
        return "NaN" if np.isnan(value) else f"{float(value):.6g}"
    return str(value)


def table_lines(index: list[Any], header: list[Any], rows: list[list[Any]], width: int) -> list[str]:
    """A table as pandas prints a frame: the index (column names) left, each column right-aligned to its widest
    cell, in blocks of columns that fit ``width`` (each block repeats the index), blank lines between blocks."""
    names = [cell(n) for n in index]
    left = max(map(len, names), default=0)
    columns = [[cell(h), *(cell(row[j]) for row in rows)] for j, h in enumerate(header)]
    widths = [max(map(len, c)) for c in columns]
    blocks: list[list[int]] = [[]]
    used = left
    for j, w in enumerate(widths):
        if blocks[-1] and used + GAP + w > width:
            blocks.append([])
            used = left
        blocks[-1].append(j)
        used += GAP + w
    lines: list[str] = []
    for b, block in enumerate(blocks):
        if b:
            lines.append("")
        for i in range(len(names) + 1):
            text = (" " * left if i == 0 else f"{names[i - 1]:<{left}}")
            text += "".join(" " * GAP + f"{columns[j][i]:>{widths[j]}}" for j in block)
            lines.append(text.rstrip())
    return lines


def array_lines(array: np.ndarray, width: int) -> list[str]:
    """An array that is not by column (quantile levels, bin edges, a Gram matrix), as numpy prints it, long ones
    summarised."""
    if array.dtype == object:
        array = np.vectorize(cell, otypes=[object])(array)
    with np.printoptions(threshold=200, edgeitems=4, linewidth=width, precision=6):
        return ["  " + line for line in np.array2string(array).splitlines()]


def main(argv: list[str]) -> int:
    """``show``'s command line (``argv`` after ``show``): prints the table and returns the exit status."""
    if any(arg in ("-h", "--help", "-help") for arg in argv):
        print(USAGE)
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print(f"error: show takes one WORKDIR, got {' '.join(argv) or 'none'}; {USAGE}.", file=sys.stderr)
        return EXIT_USAGE
    try:
        text = show_text(argv[0], shutil.get_terminal_size((80, 24)).columns)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(text)
    return 0


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
