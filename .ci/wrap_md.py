"""Wrap a Markdown file's lines longer than 120 characters, in place, changing no word.

Prose and list items break at spaces (a continuation keeps the item's indent, never starts with
what Markdown reads as a new block); a table with a row too long becomes a list, a row an item
(``- first cell — header: cell; ...``); lines inside code fences are left alone (reported).
Usage: ``python .ci/wrap_md.py FILE.md ...``; tests/test_docs.py checks the limit.
"""

from __future__ import annotations

import re
import sys

WIDTH = 120
BLOCK_START = re.compile(r"^(?:[-+*>#|=]|\d+[.)]|```|<!--)(?:\s|$)|^```|^<!--")
ITEM = re.compile(r"^(\s*(?:[-+*]|\d+[.)])\s+|\s*>\s?|\s*)")


def wrap_line(line: str) -> list[str]:
    if len(line) <= WIDTH:
        return [line]
    lead = ITEM.match(line).group(1)
    indent = lead if lead.strip() in ("", ">") else " " * len(lead)
    words = line[len(lead):].split(" ")
    out, cur, prefix = [], "", lead
    for word in words:
        trial = f"{cur} {word}" if cur else word
        if cur and len(prefix) + len(trial) > WIDTH and not BLOCK_START.match(word):
            out.append(prefix + cur)
            cur, prefix = word, indent
        else:
            cur = trial
    out.append(prefix + cur)
    return out


def cells(row: str) -> list[str]:
    parts = re.split(r"(?<!\\)\|", row.strip())
    return [p.strip() for p in parts[1:-1]]


def table_as_list(rows: list[str]) -> list[str]:
    header, body = cells(rows[0]), [cells(r) for r in rows[2:]]
    out = []
    for row in body:
        if len(header) == 2:
            item = f"- {row[0]}: {row[1]}"
        else:
            item = f"- {row[0]} — " + "; ".join(f"{h}: {c}" for h, c in zip(header[1:], row[1:], strict=True))
        out += wrap_line(item)
    return out


def wrap(text: str) -> tuple[str, list[int]]:
    lines, out, left, fenced, i = text.split("\n"), [], [], False, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            fenced = not fenced
        if fenced or line.startswith("```"):
            if len(line) > WIDTH:
                left.append(i + 1)
            out.append(line)
            i += 1
            continue
        if line.startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            table = lines[i:j]
            out += table_as_list(table) if any(len(r) > WIDTH for r in table) else table
            i = j
            continue
        out += wrap_line(line)
        i += 1
    return "\n".join(out), left


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            new, left = wrap(f.read())
        with open(path, "w") as f:
            f.write(new)
        for n in left:
            print(f"{path}:{n}: a code line over {WIDTH} characters, left as it is")
