"""The project's Markdown keeps its lines to 120 characters, as ruff keeps the code's: a diff then shows
which sentence changed. ``python .ci/wrap_md.py FILE.md`` wraps a file's long lines without changing a word.
No JAX, no subprocess: the fast tier runs it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 120
LEFT_OUT = {"shared", "node_modules", "build", "dist", "site-packages", "__pycache__"}  # not the project's text


def ours(top: str, name: str) -> bool:
    """A folder of the project's own files: not hidden, not a build output, not a virtual environment."""
    return (not name.startswith(".") and name not in LEFT_OUT and not name.endswith(".egg-info")
            and not os.path.exists(os.path.join(top, name, "pyvenv.cfg")))


def markdown_files() -> list[Path]:
    found = []
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if ours(top, d)]
        found += [Path(top, f).relative_to(ROOT) for f in files if f.endswith(".md")]
    return sorted(found)


def test_no_markdown_line_longer_than_120():
    files = markdown_files()
    assert {"README.md", "DESIGN.md", "WORKSPACE.md", "bench/README.md"} <= {str(f) for f in files}, files
    long = [f"{f}:{n}: {len(line)} characters" for f in files
            for n, line in enumerate((ROOT / f).read_text(encoding="utf-8").splitlines(), 1) if len(line) > WIDTH]
    assert not long, "lines over 120 characters (python .ci/wrap_md.py FILE.md wraps them):\n" + "\n".join(long)


def test_wrap_md_wraps_prose_lists_and_tables_and_keeps_every_word():
    spec = importlib.util.spec_from_file_location("wrap_md", ROOT / ".ci" / "wrap_md.py")
    wrap_md = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wrap_md)
    words = " ".join(f"w{i}" for i in range(60))
    text = "\n".join([
        f"{words} - 1. # not a new block", f"  - {words}", "| a | b |", "|---|---|", f"| `x` | {words} |",
        "| short | table |", "```", "x" * 130, "```", ""])
    new, left = wrap_md.wrap(text)
    lines = new.split("\n")
    assert left == [8] and "x" * 130 in lines  # code is left alone, and said so
    assert all(len(line) <= WIDTH for line in lines if line != "x" * 130)
    assert not any(line.lstrip().startswith(("- 1.", "1.", "#")) for line in lines), lines  # no new blocks
    item = lines.index(next(line for line in lines if line.startswith("  - w0")))
    assert lines[item + 1].startswith("    w") and any(line.startswith("- `x`: w0") for line in lines)  # indents
    assert new.split() == [*f"{words} - 1. # not a new block".split(), "-", *words.split(), "-", "`x`:",
                           *words.split(), "-", "short:", "table", "```", "x" * 130, "```"]
