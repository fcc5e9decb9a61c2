"""The house's rules, checked on its import graph.

The graph has one node per module of ``ptcfs`` (``server/`` and ``client/``
as ``ptcfs.server`` and ``ptcfs.client``) and an edge for every import
statement, those inside functions and under ``TYPE_CHECKING`` included: a
loop hidden in a function is still a loop. Name tables loaded by
``importlib`` (``ptcctl``'s commands, the daemon's handler modules, the
checkpoint formats) are registries, not imports, and are not edges.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"ptcfs": ROOT / "ptcfs", "ptcfs.server": ROOT / "server",
            "ptcfs.client": ROOT / "client"}


def modules() -> dict[str, Path]:
    """Every module's dotted name → its file."""
    found: dict[str, Path] = {}
    for pkg, top in PACKAGES.items():
        for f in sorted(top.rglob("*.py")):
            parts = list(f.relative_to(top).with_suffix("").parts)
            if pkg == "ptcfs" and parts[0] in ("server", "client"):
                continue  # the links to the top-level folders
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([pkg, *parts])] = f
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """The modules of ``known`` that ``name`` imports, with the line of each import."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                yield t, node.lineno


def graph() -> dict[str, dict[str, int]]:
    known = modules()
    return {m: dict(imported(m, f, known)) for m, f in known.items()}


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_inside_functions(tmp_path: Path) -> None:
    # the checks below are only as good as the graph: a function's import is an edge
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from ptcfs.errors import PtcError\n")
    assert dict(imported("ptcfs.m", f, {"ptcfs.errors": f, "ptcfs.m": f})) == {"ptcfs.errors": 2}


def test_no_import_cycles() -> None:
    edges = graph()
    loops = cycles(edges)
    shown = [" <-> ".join(c) + ": " + ", ".join(
        f"{a} imports {b} (line {edges[a][b]})" for a in c for b in c if b in edges[a])
        for c in loops]
    assert not loops, "import cycles:\n" + "\n".join(shown)


@pytest.mark.parametrize("room, forbidden", [
    # the wire both sides speak knows neither side's logic
    ("ptcfs.server.net", ("ptcfs.client", "ptcfs.server.ops", "ptcfs.server.daemon",
                          "ptcfs.server.testing")),
    # the daemon's handlers never reach into ptcctl's side or the harnesses
    ("ptcfs.server.ops", ("ptcfs.client", "ptcfs.server.testing")),
    ("ptcfs.server.daemon", ("ptcfs.client", "ptcfs.server.testing")),
    # the core imports neither the daemon nor the client
    ("ptcfs", ("ptcfs.client", "ptcfs.server")),
])
def test_layers_point_one_way(room: str, forbidden: tuple[str, ...]) -> None:
    edges = graph()
    bad = [f"{a} imports {b} (line {line})" for a, targets in edges.items()
           if (a == room or a.startswith(room + "."))
           and not (room == "ptcfs" and a.startswith(("ptcfs.client", "ptcfs.server")))
           for b, line in targets.items() if b.startswith(forbidden)]
    assert not bad, "\n".join(bad)


def test_every_error_class_is_in_ptcfs_errors() -> None:
    known = modules()
    errors_module = known["ptcfs.errors"]
    bases = {"Exception", "PtcError", "BadInput", "InvalidConfig", "PeerError"}
    outside = []
    for name, path in known.items():
        if path == errors_module:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    (b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")) in bases
                    or (isinstance(b, ast.Name) and b.id.endswith("Error"))
                    for b in node.bases):
                outside.append(f"{name}.{node.name} (line {node.lineno})")
    assert not outside, "error classes outside ptcfs/errors.py: " + ", ".join(outside)


def test_no_room_of_the_training_face_hides_a_name_of_the_face() -> None:
    """Importing ``ptcfs.client.torch.X`` sets the package's attribute ``X``
    to that module: a module named like a name of the face (``attach``,
    ``start``, ...) would replace the function once anything imported it."""
    import pkgutil

    import ptcfs.client.torch as face

    rooms = {m.name for m in pkgutil.iter_modules(face.__path__)}
    assert not rooms & set(face.__all__), rooms & set(face.__all__)
