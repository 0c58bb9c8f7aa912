"""Strict configuration decoding: unknown keys and wrong types are errors that name the key's path.

Every config section (the top level of `--config-file`, `admission`, `scheduling` and each plugin's
`parameters`) is a `Section`: a pydantic model that forbids extra keys, takes GIE's camelCase names (snake_case
too, for code), and reports problems as `ConfigError("scheduling.plugins[2].parameters.ratioWeight: ...")`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class ConfigError(ValueError):
    """A configuration problem; the message starts with the offending key's path."""


def parse_duration(value: str | float | int) -> float:
    """"50ms", "0.5s", "2m" or a number of seconds → seconds (GIE-style flag values)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration (e.g. 50ms, 0.5s, 2m)")
    if isinstance(value, int | float):
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a duration (e.g. 50ms, 0.5s, 2m)")
    match = _DURATION.match(value)
    if not match:
        raise ValueError(f"{value!r} is not a duration (e.g. 50ms, 0.5s, 2m)")
    if match.group(2) is None and float(match.group(1)) != 0:
        # as Go's time.ParseDuration (GIE's flags): "50" could mean 50 ms or 50 s, so it needs its unit
        raise ValueError(f"{value!r} needs a unit: {value.strip()}ms or {value.strip()}s")
    return float(match.group(1)) * _UNITS[match.group(2)]


Duration = Annotated[float, BeforeValidator(parse_duration)]


class Section(BaseModel):
    """Base of every config section: strict about keys, camelCase in YAML, immutable once decoded."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True,
                              validate_default=True)


S = TypeVar("S", bound=Section)


def decode(model: type[S], data: Mapping[str, Any] | None, path: str) -> S:
    """`data` as `model`, or ConfigError naming every bad key under `path` (e.g. "admission")."""
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: must be a mapping, not {type(data).__name__}")
    try:
        return model.model_validate(dict(data or {}))
    except ValidationError as exc:
        raise ConfigError(describe(exc, path)) from None


def describe(exc: ValidationError, path: str, top_names: Mapping[str, str] | None = None) -> str:
    """One clause per problem: "<key path>: <what is wrong>"; `top_names` respells first-level keys."""
    lines = []
    for error in exc.errors(include_url=False):
        loc = list(error["loc"])
        if top_names and loc and isinstance(loc[0], str):
            loc[0] = top_names.get(loc[0], loc[0])
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        elif message.startswith("Value error, "):
            message = message[len("Value error, "):]
        lines.append(f"{join_path(path, loc)}: {message}")
    return "; ".join(lines)


def join_path(path: str, loc: Sequence[int | str]) -> str:
    out = path
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part and not part.startswith("function-"):
            out = f"{out}.{part}" if out else str(part)
    return out or "config"
