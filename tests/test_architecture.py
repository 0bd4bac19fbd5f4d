"""The shape of the core, checked from its source (docs/architecture.md draws it).

- no import circle in ``warmreg`` (every import counts: top-level, inside functions, under TYPE_CHECKING);
- the layers: the contract and the pipeline never import an add-on (packs, distributed, monitor) nor
  an entry point (``warmup``, the CLI, the pytest plugin); add-ons never import an entry point; the
  adapters (Triton's, and the engines' config readers) import nothing above the contract's values;
- the core (contract + pipeline) stays within 2,750 lines (2,461 before autotune support, which added 155; `warmreg.output`, the one check of an op's out= buffer, and the kernels' `rehearse` flag added 45; a launch that keeps its launch code's signature, instead of a ``*args, **kwargs`` forwarder costing ~0.8 µs a launch, 20; a stage finishing keys itself, for the forked compile of the misses: its progress and the precompiled status, 20; a warm of hits loading its modules on one thread and only C-launcher builds on the pool, 10) and ``warm()`` within 40;
- every module's ``__all__`` lists exactly its public names (re-exports allowed, nothing missing).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "warmreg"

CONTRACT = {"errors", "key", "platform", "config", "domains", "space", "hookspecs", "registry", "kernel", "launch"}
PIPELINE = {"plugins", "planning", "bind", "compile", "stage", "pipeline", "report"}
ADAPTER = {"_triton", "_triton_cache", "_triton_fast", "_triton_interp", "_triton_launchers", "_triton_release", "engines"}
SUPPORT = {"_entry_points", "_json", "_output", "_version"}
ADDONS = {
    "pack", "_pack_format", "_pack_install", "_pack_reader", "_pack_wheel", "distributed", "monitoring", "replay", "coverage",
    "tuning", "rehearsal", "processes",
}  # fmt: skip
ENTRY = {"warmup", "startup", "cli", "_cli_common", "cli_pack", "cli_monitor", "pytest_plugin", "__init__", "__main__"}
#: what each layer may import (besides itself)
ALLOWED = {
    "support": {"errors"},
    "adapter": {"support", "errors", "platform"},
    "contract": {"support", "adapter"},
    "pipeline": {"support", "adapter", "contract"},
    "addons": {"support", "adapter", "contract", "pipeline"},
    "entry": {"support", "adapter", "contract", "pipeline", "addons", "ops"},
    "ops": {"support", "contract"},
}


def _modules() -> dict[str, Path]:
    found = {p.stem: p for p in ROOT.glob("*.py")}
    found.update({f"ops.{p.stem}": p for p in (ROOT / "ops").glob("*.py")})
    return found


def _layer(module: str) -> str:
    if module.startswith("ops."):
        return "ops"
    for name, members in (
        ("contract", CONTRACT), ("pipeline", PIPELINE), ("adapter", ADAPTER), ("support", SUPPORT), ("addons", ADDONS),
        ("entry", ENTRY),
    ):  # fmt: skip
        if module in members:
            return name
    raise AssertionError(f"warmreg/{module}.py is in no layer: add it to one in tests/test_architecture.py and docs/architecture.md")


def _imports(module: str, path: Path) -> set[str]:
    """The warmreg modules ``module`` imports, anywhere in its source."""
    package = module.rpartition(".")[0]  # "ops" for ops.x, "" for a core module
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module or "").startswith("warmreg"):
                    continue
                base = (node.module or "").removeprefix("warmreg").lstrip(".")
            else:
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join([*parts, *([node.module] if node.module else [])])
            if node.module is None or (node.level == 0 and base == ""):
                out.update(f"{base}.{a.name}".lstrip(".") for a in node.names)
            else:
                out.add(base)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("warmreg.") for a in node.names if a.name.startswith("warmreg."))
    known = _modules()
    resolved = set()
    for name in out:
        if name in known:
            resolved.add(name)
        elif name == "" or name == "ops":
            resolved.add("__init__" if name == "" else "ops.__init__")
        elif name.split(".")[0] in known:
            resolved.add(name.split(".")[0])
    resolved.discard(module)
    return resolved


GRAPH = {m: _imports(m, p) for m, p in _modules().items()}


def test_every_module_has_a_layer() -> None:
    for module in GRAPH:
        _layer(module)


def test_no_import_circle() -> None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(GRAPH.get(m, ())):
            if state.get(n) == 1:
                raise AssertionError(f"import circle: {' -> '.join(path[path.index(n):] + [n])}")
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_follow_the_layers(module: str) -> None:
    layer = _layer(module)
    for imported in sorted(GRAPH[module]):
        if imported == "errors" or _layer(imported) == layer:
            continue
        other = imported if imported in ALLOWED[layer] else _layer(imported)
        assert other in ALLOWED[layer], f"warmreg/{module}.py ({layer}) imports warmreg/{imported}.py ({_layer(imported)})"


def _lines(modules: set[str]) -> int:
    return sum(len((ROOT / f"{m}.py").read_text().splitlines()) for m in modules)


def test_the_core_reads_in_one_sitting() -> None:
    assert _lines(CONTRACT | PIPELINE) <= 2750


def test_warm_is_short() -> None:
    tree = ast.parse((ROOT / "warmup.py").read_text())
    (warm,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "warm"]
    assert warm.end_lineno is not None and warm.end_lineno - warm.lineno + 1 <= 40


def _public(tree: ast.Module) -> tuple[set[str], set[str], set[str] | None]:
    """Public names a module defines, names it imports, and its ``__all__``."""
    defined: set[str] = set()
    imported: set[str] = set()
    declared = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
    for node in tree.body:
        body = node.body if isinstance(node, ast.Try) else [node]
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
                defined.add(n.name)
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Name):
                    if t.id == "__all__":
                        declared = set(ast.literal_eval(n.value))  # type: ignore[arg-type]
                    else:
                        defined.add(t.id)
    public = {n for n in defined if not n.startswith("_") or n == "__version__"} - {"log"}
    return public, imported, declared


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if not m.endswith(("__init__", "__main__"))))
def test_all_lists_exactly_the_public_names(module: str) -> None:
    path = ROOT / (module.replace(".", "/") + ".py")
    public, imported, declared = _public(ast.parse(path.read_text()))
    assert declared is not None, f"{path.name} has no __all__"
    assert not public - declared, f"{path.name}: public but not in __all__: {sorted(public - declared)}"
    assert not declared - public - imported, f"{path.name}: in __all__ but not defined: {sorted(declared - public - imported)}"


def test_the_package_exports_what_it_lists() -> None:
    import warmreg

    for name in warmreg.__all__:
        assert getattr(warmreg, name) is not None
    assert callable(warmreg.warm) and callable(warmreg.monitor)
    import warmreg.monitoring
    import warmreg.warmup  # importing the modules rebinds nothing: no module shares a function's name

    assert callable(warmreg.warm) and callable(warmreg.monitor) and warmreg.monitoring.current() is None
