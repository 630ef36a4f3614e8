"""The image: Ray's base image at the pinned Ray version, pagefleet installed from the checkout
as the README says. No Docker engine here, so the Dockerfile is parsed, not built."""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from typing import Any

import pytest
from dockerfile_parse import DockerfileParser

from .conftest import CHART, REPO, chart_values

DOCKERFILE = REPO / "Dockerfile"
READMES = (REPO / "README.md", CHART / "README.md")


def ray_pin() -> str:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [m.group(1) for d in deps if (m := re.fullmatch(r"ray\[serve\]==(\S+)", d))]
    return pin


@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    return DockerfileParser(str(DOCKERFILE))


def _instructions(parser: DockerfileParser, name: str) -> list[str]:
    return [i["value"] for i in parser.structure if i["instruction"] == name]


def test_base_image_is_ray_at_the_pinned_version(dockerfile: DockerfileParser) -> None:
    pin = ray_pin()
    assert dockerfile.baseimage == f"rayproject/ray:{pin}-py311"
    gpu = DockerfileParser(str(DOCKERFILE), build_args={"RAY_IMAGE_SUFFIX": "-gpu"})
    assert gpu.baseimage == f"rayproject/ray:{pin}-py311-gpu"
    cuda = DockerfileParser(str(DOCKERFILE), build_args={"RAY_IMAGE_SUFFIX": "-cu128"})
    assert cuda.baseimage == f"rayproject/ray:{pin}-py311-cu128"
    # One stage: the Ray image is what every Ray pod runs.
    assert len(_instructions(dockerfile, "FROM")) == 1


def test_chart_ray_version_is_the_pin() -> None:
    assert chart_values()["rayVersion"] == ray_pin()


def test_copies_what_pip_install_builds(dockerfile: DockerfileParser) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    package_dirs = {p.split(".")[0] for p in project["tool"]["setuptools"]["packages"]}
    copied: set[str] = set()
    for value in _instructions(dockerfile, "COPY"):
        parts = [p for p in shlex.split(value) if not p.startswith("--")]
        copied |= {p.rstrip("/") for p in parts[:-1]}
    assert package_dirs | {"pyproject.toml", project["project"]["readme"]} <= copied
    for path in copied:
        assert (REPO / path).exists(), path
    # .dockerignore keeps the context small (.venv, models) without hiding a copied path.
    ignored = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert {".venv", "models", ".git"} <= set(ignored)
    for path in copied:
        assert not any(fnmatch.fnmatch(path, pattern) for pattern in ignored), path


def _pip_install_targets(command: str) -> list[str]:
    """Positional arguments of every `pip install` in a shell command line."""
    targets = []
    for part in re.split(r"&&|;", command):
        words = shlex.split(part)
        if words[:2] in (["pip", "install"], ["python", "-m"]) and "install" in words:
            args = words[words.index("install") + 1 :]
            skip = False
            for word in args:
                if skip:
                    skip = False
                elif word.startswith("-"):
                    skip = word in {"--extra-index-url", "--index-url", "-i", "-c", "-r"}
                else:
                    targets.append(word)
    return targets


def test_installs_the_checkout_as_the_readme_says(dockerfile: DockerfileParser) -> None:
    runs = _instructions(dockerfile, "RUN")
    assert [t for r in runs for t in _pip_install_targets(r)] == ["."]
    # The chart README's image section says the same.
    readme = (CHART / "README.md").read_text()
    assert "`pip install .`" in readme
    assert f"rayproject/ray:{ray_pin()}-py311" in readme


def _build_args(text: str) -> set[str]:
    return set(re.findall(r"--build-arg\s+([A-Z_]+)=", text))


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_readme_build_commands_use_the_dockerfiles_args(
    dockerfile: DockerfileParser, readme: Any
) -> None:
    text = readme.read_text()
    assert "docker build" in text
    declared = set(re.findall(r"^ARG\s+([A-Z_]+)", DOCKERFILE.read_text(), re.M))
    assert _build_args(text) <= declared
    assert "RAY_IMAGE_SUFFIX" in _build_args(text)  # the CUDA variant is documented


def test_runs_as_rays_uid_as_the_chart_does(dockerfile: DockerfileParser) -> None:
    """Non-root by number (the chart's runAsNonRoot holds without runAsUser too), the same user
    and group as the chart's podSecurityContext, which owns what COPY put in the image."""
    assert _instructions(dockerfile, "USER")[-1] == "1000:100"
    pod = chart_values()["podSecurityContext"]
    assert (pod["runAsUser"], pod["runAsGroup"], pod["fsGroup"]) == (1000, 100, 100)
    assert pod["runAsNonRoot"] is True
    for value in _instructions(dockerfile, "COPY"):
        assert value.startswith("--chown=ray:users ")
