"""The shape of src/leaplm's imports: no cycles, every import runs down the layers below, typer only in cli/, and
no module takes another module's private (_underscored) names.

The graph is read with `ast` from the source, so imports inside functions (lazy ones) count as much as those at
the top of a module; importing a.b.c also imports the packages a.b and a (their __init__), except the package
root leaplm, whose __init__ is always the first thing running.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "leaplm"

# Top to bottom. A module may import its own package's modules and those of packages in lower layers; never a
# package in its own layer or above. "leaplm" is the package's public API (leaplm/__init__.py); config, devices,
# numerics and errors are top-level modules. A package's __main__ is a command-line entry point: it sits with cli.
LAYERS = [
    ["cli"],                      # the command line: the only package importing typer
    ["deploy", "tune"],           # scale-out recipes; the advisor (measures with bench's runner)
    ["server", "bench"],          # the HTTP server; benchmarks (read training's corpus)
    ["training"],                 # recipes that train drafts and heads (run the engine)
    ["leaplm"],
    ["engine"],                   # the step, the public Engine, the scheduler
    ["propose"],                  # proposers (read heads' networks)
    ["heads"],
    ["verify", "models", "structured"],   # structured: output constraints (the step applies them)
    ["quant"],
    ["kernels", "cache"],
    ["sampling"],
    ["devices", "numerics", "faults", "startup_cache"],   # faults: injected on purpose by the reliability tests;
                                  # startup_cache: what start-ups measure once per machine and model file
    ["config"],
    ["errors"],                   # the error types config and the rest raise
]
CLI_ONLY = ("typer", "click")     # command-line libraries: imported in cli/ alone


@dataclass(frozen=True)
class Edge:
    source: str        # importing module, e.g. leaplm.engine.step
    target: str        # imported module (or package), e.g. leaplm.verify
    line: int
    implicit: bool = False   # a package whose __init__ runs because a module inside it is imported


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under root (a package directory)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(root: Path) -> tuple[list[Edge], list[Edge]]:
    """(edges between the package's own modules, imports of CLI_ONLY libraries) of every module under root."""
    mods = modules(root)
    top = root.name

    def known(name: str) -> str:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    edges, cli_libs = [], []
    for mod, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(mod, is_package, node)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for name in names:
                if name.split(".")[0] in CLI_ONLY:
                    cli_libs.append(Edge(mod, name, node.lineno))
                elif name == top or name.startswith(top + "."):
                    target = known(name)
                    parts = target.split(".")
                    # the packages above the target run first (their __init__), the root excepted
                    for i in range(2, len(parts) + 1):
                        t = ".".join(parts[:i])
                        if t != mod and not mod.startswith(t + "."):
                            edges.append(Edge(mod, t, node.lineno, implicit=i < len(parts)))
    return sorted(set(edges), key=lambda e: (e.source, e.target, e.line)), cli_libs


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_of(module: str) -> str:
    """leaplm.engine.step -> engine; leaplm.config -> config; leaplm -> leaplm; a __main__ -> cli."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "cli"
    return parts[1] if len(parts) > 1 else parts[0]


def layer_of(package: str, layers: list[list[str]]) -> int:
    for i, names in enumerate(layers):
        if package in names:
            return i
    raise KeyError(package)


def upward(edges: list[Edge], layers: list[list[str]]) -> list[str]:
    """Imports of a package in the importer's layer or above (its own package excepted), and packages that
    have no layer."""
    bad = []
    for e in edges:
        if e.implicit:
            continue
        src, dst = package_of(e.source), package_of(e.target)
        if src == dst:
            continue
        for p in (src, dst):
            try:
                layer_of(p, layers)
            except KeyError:
                bad.append(f"{p}: no layer declared (add it to LAYERS in tests/test_imports.py)")
                break
        else:
            if layer_of(dst, layers) <= layer_of(src, layers):
                bad.append(f"{e.source} (line {e.line}) imports {e.target}: {src} is not above {dst}")
    return sorted(set(bad))


def private_names(root: Path) -> list[str]:
    """`from module import _name`: a name another module keeps private, taken from inside the package."""
    top, found = root.name, []
    for mod, path in modules(root).items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = _absolute(mod, is_package, node)
                if base == top or base.startswith(top + "."):
                    found += [f"{mod} (line {node.lineno}) imports {base}.{a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def typer_outside_cli(cli_libs: list[Edge]) -> list[str]:
    return [f"{e.source} (line {e.line}) imports {e.target}" for e in cli_libs if package_of(e.source) != "cli"]


# ---- the checks on src/leaplm -------------------------------------------------------------------------------

def test_no_import_cycles():
    edges, _ = imports(SRC)
    assert len(edges) > 300                 # the graph was read (leaplm's modules import each other a lot)
    found = cycles(edges)
    assert not found, "modules importing each other, directly or around a loop:\n" + "\n".join(
        ", ".join(c) for c in found)


def test_imports_run_down_the_layers():
    edges, _ = imports(SRC)
    bad = upward(edges, LAYERS)
    assert not bad, "imports against the layer order (LAYERS):\n" + "\n".join(bad)


def test_typer_only_in_cli():
    _, cli_libs = imports(SRC)
    assert any(package_of(e.source) == "cli" for e in cli_libs)
    bad = typer_outside_cli(cli_libs)
    assert not bad, "command-line libraries outside cli/:\n" + "\n".join(bad)


def test_no_private_names_taken_from_another_module():
    bad = private_names(SRC)
    assert not bad, "private names used outside their module (make them public, or move them):\n" + "\n".join(bad)


# ---- the checker finds what it is meant to find (a package written for the purpose) -------------------------

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_a_lazy_cycle_an_upward_import_and_typer(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from .b import g\n",            # lazy: inside a function
        "low/b.py": "from . import a\n",
        "low/c.py": "from ..high.cmd import run\n",                 # up the layers
        "high/__init__.py": "",
        "high/cmd.py": "import typer\nfrom ..low import b\n",
        "low/d.py": "from typer import Typer\nfrom .a import _hidden, __version__\n",   # typer outside high/
    })
    layers = [["high"], ["low"]]
    edges, cli_libs = imports(root)
    assert cycles(edges) == [["pkg.low.a", "pkg.low.b"]]
    assert upward(edges, layers) == ["pkg.low.c (line 1) imports pkg.high.cmd: low is not above high"]
    assert [e.source for e in cli_libs] == ["pkg.high.cmd", "pkg.low.d"]
    assert private_names(root) == ["pkg.low.d (line 2) imports pkg.low.a._hidden"]
    assert upward(edges, [["low"]]) == ["high: no layer declared (add it to LAYERS in tests/test_imports.py)"]


def test_checker_counts_the_package_init_an_import_runs(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "from ..high import x\n",
        "low/a.py": "",
        "high/__init__.py": "",
        "high/x.py": "from ..low.a import y\n",                     # runs low/__init__, which imports high.x
    })
    edges, _ = imports(root)
    assert cycles(edges) == [["pkg.high.x", "pkg.low"]]
