"""The wheel holds the product: the packages setuptools ships are exactly pagefleet's
own folders, and none of them is the lab (lab/pagefleet_lab: the fleet simulator and the
research benchmarks, development only)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _shipped_packages() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["packages"]


def test_the_wheel_ships_every_product_package_and_nothing_of_the_lab() -> None:
    on_disk = sorted(
        ".".join(p.parent.relative_to(REPO).parts)
        for p in (REPO / "pagefleet").rglob("__init__.py")
    )
    # Data-only folders (the dashboard's page) are packages of their own.
    shipped = sorted(_shipped_packages())
    assert set(on_disk) <= set(shipped)
    assert all(p == "pagefleet" or p.startswith("pagefleet.") for p in shipped)
    assert not any("lab" in p.split(".") or "sim" in p.split(".") for p in shipped)


def test_no_simulator_or_lab_module_lives_in_the_product() -> None:
    names = [p.stem for p in (REPO / "pagefleet").rglob("*.py")]
    lab = [n for n in names if n.startswith("sim_") or n in ("simulate", "soak", "router_cost")]
    assert lab == []


@pytest.mark.slow
def test_a_built_wheel_holds_no_lab_module(tmp_path: Path) -> None:
    """`pip wheel .`, as a user's `pip install .` builds it, from a copy of what the build
    reads (no build/ folder left over from an earlier build)."""
    src = tmp_path / "src"
    shutil.copytree(
        REPO / "pagefleet", src / "pagefleet", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md", "LICENSE", "THIRD_PARTY_LICENSES"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp_path)],
        check=True,
        timeout=600,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("pagefleet-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "pagefleet/cli.py" in names and "pagefleet/bench/serve.py" in names
    assert "pagefleet/cluster/routing/policy.py" in names
    assert not [n for n in names if "pagefleet_lab" in n or "/sim_" in n or "simulate" in n]
