"""Declared settings: a config field's default, range and description, written once.

The engine's `EngineConfig`, the autoscaler's `AutoscalingPolicyConfig` and the
router's `RoutingConfig` are frozen stdlib dataclasses whose fields are declared
with `setting(default, description, ge=..., choices=..., rule=...)`. The
declaration lives in the field's metadata (`SETTING`), where two readers find it:

- the dataclass itself: `check_settings(self)`, first thing in `__post_init__`,
  raises `ValueError("<field> must be <range>, got <value>")` for any field outside
  its declared range; the class then checks what spans fields (and, for the engine,
  what depends on the machine) itself;
- the serving schema: `pagefleet.cluster.config` builds its pydantic models
  (`EngineSettings`, `AutoscalingSettings`, and `routing:`) from
  `dataclasses.fields()`, turning each `Setting` into pydantic's own constraints
  (`ge`/`gt`/`le`/`lt`, a `Literal` of the choices, a validator for a `rule`), so a
  config file's errors name the key (`engine.block_size: ...`) and the Helm chart's
  generated JSON schema shows every key's description and range.

This module imports neither torch nor pydantic: `pagefleet/cluster/autoscaling.py` runs in Serve's
controller and `pagefleet/cli.py` answers `--help` at once, and both read it.

`DTYPES` is the engine's dtypes by name, for the same reason here rather than in
`pagefleet/engine/config.py` (which maps each name to its torch dtype).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The metadata key of a declared field.
SETTING = "pagefleet.setting"

# The engine's weight and KV-cache dtypes (`EngineConfig.dtype`, `pagefleet generate --dtype`).
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Rule:
    """A check no bound or list of choices expresses: `test(value)`, described by `text`
    ("a power of two"), which completes "must be ..." and "Input should be ..."."""

    test: Callable[[Any], bool]
    text: str


@dataclass(frozen=True)
class Setting:
    """One field's declaration. None (the value) is always allowed where the default is
    None: it means "not set" and is never range-checked."""

    description: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] | None = None
    rule: Rule | None = None

    def bounds(self) -> dict[str, float]:
        """The numeric bounds that are set, by pydantic's names (ge, gt, le, lt)."""
        return {
            k: v
            for k, v in (("ge", self.ge), ("gt", self.gt), ("le", self.le), ("lt", self.lt))
            if v is not None
        }

    def range_text(self) -> str:
        """What "must be ..." says: "a power of two in [1, 128]", ">= 1", "in (0, 1]"."""
        parts = [self.rule.text] if self.rule is not None else []
        if self.choices is not None:
            parts.append(f"one of {self.choices}")
        low = ("[", ">=", self.ge) if self.ge is not None else ("(", ">", self.gt)
        high = ("]", "<=", self.le) if self.le is not None else (")", "<", self.lt)
        if low[2] is not None and high[2] is not None:
            parts.append(f"in {low[0]}{_num(low[2])}, {_num(high[2])}{high[0]}")
        elif low[2] is not None:
            parts.append(f"{low[1]} {_num(low[2])}")
        elif high[2] is not None:
            parts.append(f"{high[1]} {_num(high[2])}")
        return " ".join(parts)

    def accepts(self, value: Any) -> bool:
        if self.choices is not None and value not in self.choices:
            return False
        if self.rule is not None and not self.rule.test(value):
            return False
        bounds = self.bounds()
        if not bounds:
            return True
        if not isinstance(value, int | float):
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def setting(
    default: Any = dataclasses.MISSING,
    description: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple[Any, ...] | None = None,
    rule: Rule | None = None,
) -> Any:
    """A dataclass field carrying its `Setting` (no default: a required field)."""
    if not description:
        raise ValueError("a setting needs a description")
    declared = Setting(description, ge=ge, gt=gt, le=le, lt=lt, choices=choices, rule=rule)
    return dataclasses.field(default=default, metadata={SETTING: declared})


def declared(field: dataclasses.Field[Any]) -> Setting | None:
    return field.metadata.get(SETTING)


def check_settings(obj: Any) -> None:
    """Raise ValueError naming the first field of dataclass `obj` outside its declared range."""
    for f in dataclasses.fields(obj):
        decl = declared(f)
        value = getattr(obj, f.name)
        if decl is None or (value is None and f.default is None):
            continue
        if not decl.accepts(value):
            raise ValueError(f"{f.name} must be {decl.range_text()}, got {value!r}")


def is_power_of_two(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


POWER_OF_TWO = Rule(is_power_of_two, "a power of two")
