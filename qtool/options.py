"""Declared options: dataclass fields carry their range/choices; `parse_options` checks a YAML mapping against
them and reports the first problem as `file:key: found X, expected Y`."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from qtool.errors import RecipeError


def option(
    default: Any = dataclasses.MISSING,
    *,
    min: float | None = None,
    max: float | None = None,
    help: str = "",
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    meta = {"min": min, "max": max, "help": help}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _describe(tp: Any, meta: dict) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_describe(a, meta) for a in args) + " or null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list of " + _describe(typing.get_args(tp)[0], {}) + "s"
    if dataclasses.is_dataclass(tp):
        return "a mapping with keys " + ", ".join(f.name for f in dataclasses.fields(tp))
    name = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}.get(tp, str(tp))
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f"{name} in {lo}..{hi}"
    if lo is not None:
        return f"{name} >= {lo}"
    if hi is not None:
        return f"{name} <= {hi}"
    return name


def _check(value: Any, tp: Any, meta: dict) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):
            return True, None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            ok, v = _check(value, arg, meta)
            if ok:
                return True, v
        return False, None
    if origin is Literal:
        return value in typing.get_args(tp), value
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            return False, None
        out = []
        for v in value:
            ok, v2 = _check(v, item, {})
            if not ok:
                return False, None
            out.append(v2)
        return True, out
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return False, None
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, None
        value = float(value)
    elif tp is str:
        if not isinstance(value, str):
            return False, None
    if tp in (int, float):
        lo, hi = meta.get("min"), meta.get("max")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            return False, None
    return True, value


def _dataclass_item(tp: Any) -> type | None:
    """The item class of a `list[SomeDataclass]` annotation, else None."""
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        if dataclasses.is_dataclass(item):
            return item
    return None


def parse_options(cls: type, raw: dict, where: str) -> Any:
    """Build `cls` from `raw`, raising RecipeError naming `where.key` on unknown keys, wrong types or ranges."""
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: found {type(raw).__name__}, expected a mapping")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise RecipeError(f"{where}.{key}: unknown option; expected one of {', '.join(sorted(fields))}")
    values = {}
    for name, f in fields.items():
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecipeError(
                    f"{where}.{name}: missing; expected {_describe(hints[name], dict(f.metadata))}"
                )
            continue
        item = _dataclass_item(hints[name])
        if item is not None:
            # A list of mappings with declared options (per-target rules): each entry is parsed on its own so
            # an error names its index, e.g. `stages[0].overrides[1].bits`.
            if not isinstance(raw[name], list):
                raise RecipeError(
                    f"{where}.{name}: found {raw[name]!r}, expected {_describe(hints[name], {})}"
                )
            values[name] = [parse_options(item, v, f"{where}.{name}[{i}]") for i, v in enumerate(raw[name])]
            continue
        ok, v = _check(raw[name], hints[name], dict(f.metadata))
        if not ok:
            raise RecipeError(
                f"{where}.{name}: found {raw[name]!r}, expected {_describe(hints[name], dict(f.metadata))}"
            )
        values[name] = v
    obj = cls(**values)
    check = getattr(obj, "validate", None)
    if check is not None:
        problem = check()
        if problem:
            key, msg = problem
            raise RecipeError(f"{where}.{key}: {msg}")
    return obj


def describe_options(cls: type) -> list[tuple[str, str, str, str]]:
    """(name, expected, default, help) rows for help text."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else "required")
        )
        rows.append(
            (f.name, _describe(hints[f.name], dict(f.metadata)), repr(default), f.metadata.get("help", ""))
        )
    return rows
