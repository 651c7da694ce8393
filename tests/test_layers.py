"""The package's import graph keeps the layer table of docs/DESIGN.md ("Layers"): every module belongs to one layer,
no module imports one of a higher layer, and no import cycle exists, lazy imports (inside functions) included."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "qtool"


def layer_table() -> dict[str, int]:
    """{module prefix: layer number} from the table under `## Layers` in docs/DESIGN.md."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    table: dict[str, int] = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for name in re.findall(r"`(qtool[\w.]*)`", cells[1]):
                table[name] = int(cells[0])
    assert table, "docs/DESIGN.md has no layer table under '## Layers'"
    return table


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The qtool modules `name` imports anywhere in its source (a `from P import x` of a submodule x is an
    import of P.x, else of P)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    found.add(f"{base}.{a.name}")
                elif base in known:
                    found.add(base)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def layer_of(name: str, table: dict[str, int]) -> int | None:
    """The layer of the longest table entry that is `name` or a package holding it (the root package's entry,
    `qtool`, names its __init__ alone)."""
    prefixes = [p for p in table if name == p or ("." in p and name.startswith(p + "."))]
    return table[max(prefixes, key=len)] if prefixes else None


def test_every_module_has_a_layer():
    table = layer_table()
    missing = sorted(m for m in modules() if layer_of(m, table) is None)
    assert not missing, f"modules without a layer in docs/DESIGN.md: {missing}"


def test_no_module_imports_a_higher_layer():
    table = layer_table()
    upward = [
        f"{a} (layer {layer_of(a, table)}) imports {b} (layer {layer_of(b, table)})"
        for a, targets in sorted(graph().items())
        for b in sorted(targets)
        if (layer_of(b, table) or 0) > (layer_of(a, table) or 0)
    ]
    assert not upward, "\n".join(upward)


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    cycles = strongly_connected(graph())
    assert not cycles, f"import cycles: {cycles}"


def test_the_checks_see_a_cycle_and_an_upward_import():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    table = {"qtool": 2, "qtool.low": 0, "qtool.high": 1, "qtool.high.special": 0}
    assert layer_of("qtool.high.x", table) == 1 and layer_of("qtool.high.special.y", table) == 0
    assert layer_of("qtool", table) == 2 and layer_of("qtool.unlisted", table) is None
    src = "def f():\n    from qtool.high import x\n    from . import sibling\n"
    path = ROOT / ".pytest_cache" / "layers_probe.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(src)
    assert imports("qtool.low.mod", path, {"qtool.high", "qtool.high.x", "qtool.low.sibling"}) == {
        "qtool.high.x",
        "qtool.low.sibling",
    }
