"""Declared options: dataclass fields carry their range/choices; `parse_options` checks a YAML mapping against
them and reports the first problem as `file:key: found X, expected Y`."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, Union

import yaml

from qtool.errors import RecipeError, shown

# Every integer option fits in int64 (torch and numpy take it from there); a larger one overflows deep inside.
INT_LIMIT = 2**63 - 1


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
    name = {int: "an integer", float: "a finite number", bool: "a boolean", str: "a string"}.get(tp, str(tp))
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
        try:
            value = float(value)
        except OverflowError:  # an integer beyond any float
            return False, None
        # NaN compares false with every bound, so a range alone would let it through.
        if not math.isfinite(value):
            return False, None
    elif tp is str:
        if not isinstance(value, str):
            return False, None
    if tp is int and abs(value) > INT_LIMIT:
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
                    f"{where}.{name}: found {shown(raw[name])}, expected {_describe(hints[name], {})}"
                )
            values[name] = [parse_options(item, v, f"{where}.{name}[{i}]") for i, v in enumerate(raw[name])]
            continue
        values[name] = check_option(cls, name, raw[name], f"{where}.{name}")
    obj = cls(**values)
    check = getattr(obj, "validate", None)
    if check is not None:
        problem = check()
        if problem:
            key, msg = problem
            raise RecipeError(f"{where}.{key}: {msg}")
    return obj


def check_option(cls: type, name: str, value: Any, where: str) -> Any:
    """`value` of option `name` of `cls` checked against its declared type and range (the value as parsed), or a
    RecipeError naming `where`."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    tp = typing.get_type_hints(cls)[name]
    ok, v = _check(value, tp, dict(f.metadata))
    if not ok:
        expected = _describe(tp, dict(f.metadata))
        big = isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT
        if big and f.metadata.get("max") is None:
            expected += " (below 2^63)"
        raise RecipeError(f"{where}: found {shown(value)}, expected {expected}")
    return v


# ---- YAML with bounded work ---------------------------------------------------------------------------------

# A recipe or task file has tens to thousands of nodes; aliases (`*a`) reuse a node, and the program reading the
# result walks it once per use: a 1 KB file of nested aliases expands to billions. Past this many nodes (counted
# as expanded, in time linear in the file) the file is refused before anything walks it.
MAX_YAML_NODES = 100_000


class YAMLTooLarge(yaml.YAMLError):
    def __init__(self, nodes: int | None) -> None:
        self.problem = (
            "aliases refer to themselves (an endless expansion)"
            if nodes is None
            else f"aliases expand to more than {MAX_YAML_NODES} nodes"
        )
        self.problem_mark = None
        super().__init__(self.problem)


def _expanded_nodes(root: yaml.Node, limit: int) -> int | None:
    """How many nodes `root` stands for once every alias is expanded (capped at limit + 1); None when an alias
    refers to one of its own ancestors."""
    size: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, closing = stack.pop()
        key = id(node)
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        if closing:
            open_.discard(key)
            size[key] = min(limit + 1, 1 + sum(size[id(c)] for c in children))
            continue
        if key in size:
            continue
        if key in open_:
            return None
        open_.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)
    return size[id(root)]


class _BoundedLoader(yaml.SafeLoader):
    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        nodes = _expanded_nodes(node, MAX_YAML_NODES)
        if nodes is None or nodes > MAX_YAML_NODES:
            raise YAMLTooLarge(nodes)
        return self.construct_document(node)


def load_yaml(text: str) -> Any:
    """yaml.safe_load, refusing (YAMLTooLarge, a yaml.YAMLError) a document whose aliases expand past
    MAX_YAML_NODES nodes or into themselves."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


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
