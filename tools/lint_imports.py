"""Check the import contracts of pyproject.toml ([tool.importlinter]) with `lint-imports`.

Run from the repository's root (lint-imports puts its working directory first on the path,
where `pagefleet/` is the one package). Extra arguments go to `lint-imports` (e.g.
`--contract layers`).

    .venv/bin/python tools/lint_imports.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    if not lint_imports.exists():
        print(f"{lint_imports} not found: pip install -e '.[dev]'", file=sys.stderr)
        return 2
    # --no-cache: the graph takes well under a second; no cache folder in the checkout.
    cmd = [str(lint_imports), "--no-cache", "--no-logo", *argv]
    return subprocess.run(cmd, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
