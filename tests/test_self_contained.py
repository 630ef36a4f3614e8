"""The repository is whole: nothing it runs, tests, builds or documents points to a folder beside it.

A user's `git clone` has no notes folder beside it (the project's own notes live outside the
repository); a test or script that read it would pass here and fail for them.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The notes folder beside the repository, by a relative path or built from the
# repository's parent (spelt in parts here, so that this file does not name it).
_NOTES = "shar" + "ed"
OUTSIDE = re.compile(r"\.\./" + _NOTES + r"|parents?(\[\d\])?\s*/\s*[\"']" + _NOTES + r"[\"']")


def test_nothing_reads_a_folder_beside_the_repository() -> None:
    files = subprocess.run(
        [
            "git",
            "ls-files",
            "*.py",
            "*.sh",
            "*.toml",
            "*.yaml",
            "*.yml",
            "*.md",
            "Makefile",
            ".ci/*",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert files, "git ls-files found nothing"
    me = Path(__file__).resolve()
    found = [
        f"{name}:{n}: {line.strip()}"
        for name in files
        if (REPO / name).resolve() != me and (REPO / name).is_file()
        for n, line in enumerate((REPO / name).read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, "\n".join(found)


def test_every_code_package_is_in_the_distribution() -> None:
    """`pip install .` (the Dockerfile's) installs only the packages pyproject.toml lists:
    a subpackage missing there works in the editable checkout and not in the image."""
    import tomllib

    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    for init in (REPO / "pagefleet").rglob("__init__.py"):
        package = ".".join(init.parent.relative_to(REPO).parts)
        assert package in listed, f"{package} ({init.parent}) is not in pyproject's packages"


def test_nothing_at_the_root_is_importable() -> None:
    """The repository's root is on sys.path under pytest and for `python -c` in a clone: a
    package folder there would shadow an installed distribution of its name (a top-level
    `kernels/` once hid Hugging Face's `kernels`, which transformers 5.25 imports)."""
    importable = sorted(
        p.name
        for p in REPO.iterdir()
        if (p / "__init__.py").is_file() or (p.suffix == ".py" and p.is_file())
    )
    assert importable == ["pagefleet", "tests"], importable
