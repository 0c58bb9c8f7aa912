"""Strict configuration decoding: unknown keys and wrong types are errors that name the key's path.

Every config section (the top level of `--config-file`, `admission`, `scheduling` and each plugin's
`parameters`) is a `Section`: a pydantic model that forbids extra keys, takes GIE's camelCase names (snake_case
too, for code), and reports problems as `ConfigError("scheduling.plugins[2].parameters.ratioWeight: ...")`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar, get_args, get_origin

import yaml
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
        raise ConfigError(describe(exc, path, model=model)) from None


def describe(exc: ValidationError, path: str, top_names: Mapping[str, str] | None = None,
             model: type[BaseModel] | None = None) -> str:
    """One clause per problem: "<key path>: <what is wrong>"; `top_names` respells first-level keys. An unknown key
    of `model` (or of a section inside it) gets the closest known one suggested, as a mistyped flag does."""
    lines = []
    for error in exc.errors(include_url=False):
        loc = list(error["loc"])
        raw_loc = tuple(loc)
        if top_names and loc and isinstance(loc[0], str):
            loc[0] = top_names.get(loc[0], loc[0])
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown key" + _suggestion(model, raw_loc, str(loc[-1]) if loc else "")
        elif message.startswith("Value error, "):
            message = message[len("Value error, "):]
        lines.append(f"{join_path(path, loc)}: {message}")
    return "; ".join(lines)


def _suggestion(model: type[BaseModel] | None, loc: tuple[int | str, ...], key: str) -> str:
    """" (did you mean logLevel?)" for a key close to one the section at `loc` knows, spelled as the user spells
    keys (dashes, underscores or camelCase); "" when none is close."""
    section = _section_at(model, loc[:-1]) if model is not None else None
    if section is None or not key:
        return ""
    known: dict[str, str] = {}
    for name, info in section.model_fields.items():
        for spelling in (name, name.replace("_", "-"), info.alias or to_camel(name)):
            known[spelling.lower()] = spelling
    if "-" in key:
        wanted = {k: v for k, v in known.items() if "_" not in v and (("-" in v) or v.islower())}
    elif "_" in key:
        wanted = {k: v for k, v in known.items() if "-" not in v and v.islower()}
    else:
        wanted = {k: v for k, v in known.items() if "-" not in v and "_" not in v}
    close = difflib.get_close_matches(key.lower(), list(wanted), n=1, cutoff=0.75)
    return f" (did you mean {wanted[close[0]]}?)" if close else ""


def _section_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model of the section at a pydantic error location inside `model` (list indices and mapping keys
    stepped over); None where the location leaves the models."""
    current: type[BaseModel] = model
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        if isinstance(part, int):
            continue
        field = current.model_fields.get(part) or next(
            (info for name, info in current.model_fields.items() if (info.alias or to_camel(name)) == part), None)
        if field is None:
            return None
        inner, keyed = _model_in(field.annotation)
        if inner is None:
            return None
        if keyed and parts:
            parts.pop(0)  # the mapping's key
        current = inner
    return current


def _model_in(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model an annotation holds (through Optional, list, tuple and dict) and whether a mapping holds it."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    keyed = get_origin(annotation) in (dict, Mapping)
    for arg in get_args(annotation):
        inner, inner_keyed = _model_in(arg)
        if inner is not None:
            return inner, keyed or inner_keyed
    return None, False


def load_yaml(text: str, source: str) -> Any:
    """YAML text read from `source` (a file name, a flag); ConfigError naming the source, the line and column and
    what is wrong there (yaml's own message names an anonymous "<unicode string>")."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f": line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        context = f" ({exc.context})" if exc.context else ""
        raise ConfigError(f"{source}{where}: {exc.problem or 'not valid YAML'}{context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML ({exc})") from None


def join_path(path: str, loc: Sequence[int | str]) -> str:
    out = path
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part and not part.startswith("function-"):
            out = f"{out}.{part}" if out else str(part)
    return out or "config"
