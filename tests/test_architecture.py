"""The shape of the core, checked from its source (docs/architecture.md draws it).

A module's layer is the first folder of its path under ``warmreg/`` (a module directly in ``warmreg/`` is
the ``top`` layer: the package facade, ``python -m warmreg``, the pytest plugin). Checked here:

- no import circle in ``warmreg`` (every import counts: top-level, inside functions, under TYPE_CHECKING);
- every import goes to the module's own layer or one below it in :data:`LAYERS`;
- docs/architecture.md lists every module with the first line of its docstring;
- the numbers of the layered core: values + contract + runtime (Python) + pipeline within
  :data:`CORE_LINES`; no module over 450 lines; no function over 60 lines; ``WarmReport`` within 12 fields;
  ``warm.py`` importing at most 6 warmreg modules; ``warm()`` within 40 lines; the pipeline naming no stage;
- every module's ``__all__`` lists exactly its public names (re-exports allowed, nothing missing).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "warmreg"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"

#: The layers, lowest first: a module may import its own layer and those before it.
LAYERS = (
    "values", "support", "_triton", "engines", "runtime", "contract", "ops", "pipeline", "stages", "monitoring", "api", "cli",
    "testing", "top",
)  # fmt: skip
#: values + contract + runtime (Python) + pipeline: what a reader of the core reads. Growth there removes as
#: much elsewhere in the same change.
CORE = ("values", "contract", "runtime", "pipeline")
CORE_LINES = 3200


def _modules() -> dict[str, Path]:
    """Dotted module name (relative to ``warmreg``) -> path, for every module of the package."""
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in sorted(ROOT.rglob("*.py"))}


def _layer(module: str) -> str:
    first = module.split(".")[0]
    layer = first if "." in module else "top"
    if layer not in LAYERS:
        raise AssertionError(f"warmreg/{first}/ is no layer: add it to LAYERS in tests/test_architecture.py and to docs/architecture.md")
    return layer


def _imports(module: str, path: Path) -> set[str]:
    """The warmreg modules ``module`` imports, anywhere in its source."""
    package = module.rpartition(".")[0]  # "pipeline" for pipeline.bind and pipeline.__init__, "" at the top
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
        while name:
            hit = next((m for m in (name, f"{name}.__init__") if m in known), None)
            if hit is not None:
                resolved.add(hit)
                break
            name = name.rpartition(".")[0]  # a name imported from a module: the module
        else:
            resolved.add("__init__")
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
def test_imports_go_down_the_layers(module: str) -> None:
    rank = LAYERS.index(_layer(module))
    for imported in sorted(GRAPH[module]):
        assert LAYERS.index(_layer(imported)) <= rank, (
            f"warmreg/{module}.py ({_layer(module)}) imports warmreg/{imported}.py ({_layer(imported)}), a layer above it"
        )


def _path(module: str) -> str:
    return "warmreg/" + module.replace(".", "/") + ".py"


def _length(module: str) -> int:
    return len(_modules()[module].read_text().splitlines())


def test_the_core_reads_in_one_sitting() -> None:
    core = [m for m in GRAPH if _layer(m) in CORE]
    total = sum(_length(m) for m in core)
    assert total <= CORE_LINES, f"values + contract + runtime + pipeline: {total} lines (budget {CORE_LINES})"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_module_is_long(module: str) -> None:
    assert _length(module) <= 450, f"{_path(module)}: {_length(module)} lines (at most 450: split it by concern)"


def test_no_function_is_long() -> None:
    long = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                if node.end_lineno - node.lineno + 1 > 60:
                    long.append(f"{_path(module)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, "functions over 60 lines: " + "; ".join(long)


def test_warm_is_short() -> None:
    tree = ast.parse(_modules()["api.warm"].read_text())
    (warm,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "warm"]
    assert warm.end_lineno is not None and warm.end_lineno - warm.lineno + 1 <= 40
    assert len(GRAPH["api.warm"]) <= 6, f"warmreg/api/warm.py imports {sorted(GRAPH['api.warm'])}: at most 6"


def test_the_report_is_small() -> None:
    import attrs

    from warmreg import WarmReport

    fields = [f.name for f in attrs.fields(WarmReport)]
    assert len(fields) <= 12, f"WarmReport has {len(fields)} fields: {fields} (at most 12: a stage's own numbers go in its section)"


def test_the_pipeline_names_no_stage() -> None:
    classes = set()
    for path in (ROOT / "stages").glob("*.py"):
        classes |= {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
    for module in (m for m in GRAPH if _layer(m) == "pipeline"):
        words = set(re.findall(r"[A-Za-z_]+", _modules()[module].read_text()))
        named = sorted(words & (classes - {"Stage"}))
        assert not named, f"{_path(module)} names the stage classes {named}: the pipeline knows only Stage"


def test_the_architecture_page_lists_every_module() -> None:
    text = DOCS.read_text()
    for module, path in _modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc, f"{_path(module)} has no docstring"
        row = f"| `{_path(module).removeprefix('warmreg/')}` | {doc.strip().splitlines()[0]} |"
        assert row in text, f"docs/architecture.md lacks the row {row!r} (regenerate it: python3 scripts/architecture-table.py)"


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
    import warmreg.api.warm  # importing the modules rebinds nothing: no module shares a function's name
    import warmreg.monitoring

    assert callable(warmreg.warm) and callable(warmreg.monitor) and warmreg.monitoring.current() is None


def test_every_error_is_defined_in_one_module() -> None:
    """Every ``WarmregError`` subclass lives in ``values/errors.py`` (other modules may re-export them)."""
    import warmreg.values.errors as errors

    names = {n for n in dir(errors) if isinstance(getattr(errors, n), type) and issubclass(getattr(errors, n), Exception)}
    for module, path in _modules().items():
        if module == "values.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                assert not bases & names, f"{_path(module)} defines the error {node.name}: define it in warmreg/values/errors.py"


def test_a_task_status_changes_in_one_place() -> None:
    """``Task.status`` is written only by ``Task.__init__`` and its transition, ``Task.to``."""
    writes = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for e in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(e, ast.Attribute) and e.attr == "status":
                        writes.append(f"{_path(module)}:{node.lineno}")
    bind = ast.parse(_modules()["pipeline.bind"].read_text())
    (task,) = [n for n in bind.body if isinstance(n, ast.ClassDef) and n.name == "Task"]
    owned = {f"warmreg/pipeline/bind.py:{n.lineno}" for f in task.body if isinstance(f, ast.FunctionDef) and f.name in ("__init__", "to") for n in ast.walk(f) if isinstance(n, ast.Assign)}
    assert writes and set(writes) <= owned, f"Task.status written outside Task.to: {sorted(set(writes) - owned)}"


def test_one_capture_of_a_launch() -> None:
    """Only ``runtime/launch.py`` sets the warm session: every capture of a launch goes through its ``capture()``."""
    for module, path in _modules().items():
        if module != "runtime.launch":
            assert "WARM_SESSION" not in path.read_text(), f"{_path(module)} sets the warm session itself: use runtime.launch.capture()"
