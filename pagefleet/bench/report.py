"""The one report writer: OUT.md (a title, the command that made it, a body of markdown)
beside OUT.png (a matplotlib figure), in benchmarks/results/ by default."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def command_line() -> str:
    """The command as typed: `pagefleet ...` or `pagefleet-lab ...`."""
    program = Path(sys.argv[0]).name
    if not program.startswith("pagefleet"):
        program = "pagefleet"
    return " ".join([program, *(shlex.quote(a) for a in sys.argv[1:])])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(out_stem: str, title: str, body: str, command: str | None = None) -> Path:
    """OUT.md headed by `title` and `command` (default: this `pagefleet` command line)
    with the time; the PNG beside it, if one was written first, linked at the end."""
    path = Path(out_stem).with_suffix(".md")
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = f"# {title}\n\nCommand: `{command or command_line()}` ({stamp})\n\n{body}\n"
    png = Path(out_stem).with_suffix(".png")
    if png.exists():
        text += f"\n![{title}]({png.name})\n"
    path.write_text(text)
    return path


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, out_stem: str | Path, dpi: int) -> Path:
    """`fig` laid out and written to OUT.png, then closed."""
    plt = pyplot()
    path = Path(out_stem).with_suffix(".png")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
