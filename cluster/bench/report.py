"""Writing benchmark results: a markdown table (with the command) and a PNG."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path


def command_line() -> str:
    return "pagefleet " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(out_stem: str, title: str, body: str) -> Path:
    path = Path(out_stem).with_suffix(".md")
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = f"# {title}\n\nCommand: `{command_line()}` ({stamp})\n\n{body}\n"
    if Path(out_stem).with_suffix(".png").exists():
        text += f"\n![{title}]({Path(out_stem).with_suffix('.png').name})\n"
    path.write_text(text)
    return path
