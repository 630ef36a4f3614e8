"""docs/configuration.md's "Fields" table names every setting of the config schema, and its
defaults are the schema's.

The settings are `ServeConfig`'s fields, a nested model's fields under its name
(`engine.dtype`, `limits.max_n`). A row's first cell names one setting or several
(`` `autoscaling.min_replicas` / `max_replicas` ``: a bare name after a dotted one
shares its prefix); its second cell gives their defaults in the same order, each as
its first code span (a default that is none, or derived from another setting, is not
compared).
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from pagefleet.cluster.config import ServeConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
ROW = re.compile(r"^\| (`[^|]+) \| ([^|]*) \|", re.MULTILINE)
SPAN = re.compile(r"`([^`]+)`")


def nested_model(annotation: Any) -> type[BaseModel] | None:
    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def settings(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Every leaf setting's dotted name and its default (None when it has none)."""
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        sub = nested_model(info.annotation)
        if sub is not None:
            out |= settings(sub, f"{prefix}{name}.")
        elif info.default_factory is not None:
            out[prefix + name] = info.default_factory()  # type: ignore[call-arg]
        else:
            out[prefix + name] = None if info.is_required() else info.default
    return out


def sections(model: type[BaseModel]) -> set[str]:
    return {n for n, i in model.model_fields.items() if nested_model(i.annotation) is not None}


def fields_table() -> str:
    text = PAGE.read_text()
    start = text.index("\n## Fields\n")
    return text[start : text.index("\n## ", start + 1)]


def documented() -> dict[str, str | None]:
    """Each documented name and its default cell's code span for it (None if none)."""
    out: dict[str, str | None] = {}
    for names_cell, default_cell in ROW.findall(fields_table()):
        names = [n for part in names_cell.split(" / ") for n in SPAN.findall(part)[:1]]
        defaults = [(SPAN.findall(p) or [None])[0] for p in default_cell.split(" / ")]
        prefix = ""
        for i, name in enumerate(names):
            if "." in name:
                prefix = name.rsplit(".", 1)[0] + "."
            elif prefix and i > 0:
                name = prefix + name
            out[name] = defaults[i] if len(defaults) == len(names) else defaults[0]
    return out


def same(doc: str, value: Any) -> bool:
    if isinstance(value, bool):
        return doc == str(value).lower()
    if isinstance(value, int | float):
        return float(doc) == float(value)
    if isinstance(value, list):
        return [s.strip() for s in doc.strip("[]").split(",")] == value
    return doc == str(value)


def test_every_setting_is_documented() -> None:
    missing = set(settings(ServeConfig)) - set(documented())
    assert not missing, f"settings missing from docs/configuration.md: {sorted(missing)}"


def test_every_documented_setting_exists() -> None:
    known = set(settings(ServeConfig)) | sections(ServeConfig)
    unknown = set(documented()) - known
    assert not unknown, f"docs/configuration.md names settings the schema lacks: {sorted(unknown)}"


def test_documented_defaults_are_the_schemas() -> None:
    docs = documented()
    wrong = [
        f"{name}: documented {docs[name]!r}, the schema's is {value!r}"
        for name, value in settings(ServeConfig).items()
        if value is not None and docs.get(name) is not None and not same(docs[name], value)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_parser_reads_combined_rows() -> None:
    docs = documented()
    assert docs["autoscaling.min_replicas"] == "1" and docs["autoscaling.max_replicas"] == "4"
    assert docs["limits.max_body_bytes"] == "2097152"
