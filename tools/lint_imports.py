"""Check the import contracts of pyproject.toml ([tool.importlinter]) with `lint-imports`.

The distribution maps `pagefleet.engine` to engine/, `pagefleet.cluster` to cluster/ and
`pagefleet.kernels` to kernels/ ([tool.setuptools] package-dir), but Grimp, the graph
builder of import-linter, looks for a package's submodules only inside the package's own
folder. So this lays `pagefleet` out as it is imported, as symlinks in a temporary folder
(pagefleet/__init__.py, pagefleet/engine -> engine/, ...), and runs `lint-imports` from
there (it puts its working directory first on the path) with the repository's
pyproject.toml. Extra arguments go to `lint-imports` (e.g. `--contract layers`).

    .venv/bin/python tools/lint_imports.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def lay_out(package_dir: dict[str, str], root: Path) -> None:
    """Symlinks under `root` that make each mapped package a folder inside its parent's."""
    for name, folder in sorted(package_dir.items(), key=lambda item: item[0].count(".")):
        dest = root.joinpath(*name.split("."))
        source = REPO / folder
        mapped_below = {
            n.split(".")[name.count(".") + 1] for n in package_dir if n.startswith(f"{name}.")
        }
        if not mapped_below:
            dest.symlink_to(source, target_is_directory=True)
            continue
        # Its subpackages live elsewhere: a real folder holding links to its own entries.
        dest.mkdir(parents=True)
        for entry in source.iterdir():
            if entry.name not in mapped_below and entry.name != "__pycache__":
                (dest / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())


def main(argv: list[str]) -> int:
    config = REPO / "pyproject.toml"
    package_dir = tomllib.loads(config.read_text())["tool"]["setuptools"]["package-dir"]
    lint_imports = Path(sys.executable).with_name("lint-imports")
    if not lint_imports.exists():
        print(f"{lint_imports} not found: pip install -e '.[dev]'", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pagefleet-imports-") as tmp:
        lay_out(package_dir, Path(tmp))
        # --no-cache: the graph takes well under a second, and a cache keyed on the
        # temporary paths would never hit.
        cmd = [str(lint_imports), "--no-cache", "--no-logo", *argv, str(config)]
        return subprocess.run(cmd, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
