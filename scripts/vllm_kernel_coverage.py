"""The vLLM coverage table of each model plugin, generated from vLLM's own source (issue 37).

Run with a vLLM venv's python; it reads the installed vLLM's files (located with ``find_spec``, never imported):

    build/engine-venvs/vllm-0.34/bin/python scripts/vllm_kernel_coverage.py

For each family of :data:`FAMILIES` it lists, by reading the source (``ast``), every Triton kernel (a function
decorated ``triton.jit``, ``triton.autotune``, ``triton.heuristics``, or a ``jit`` imported from Triton) under
vLLM's model packages of the family (``vllm/models/PREFIX*``), and in the shared modules those packages import, one
level deep: a module outside the packages that an ``import`` of theirs names (a package ``__init__``'s re-export is
followed to the module defining the name), of which only the kernels reachable from the imported names count (a
top-level definition reaches the top-level names it reads). Kernel ids are ``path/relative/to/vllm.py:function``
(``outer.inner`` for a kernel defined inside a function or class). It writes ``plugins/FAMILY/vllm_kernels.json``
(vLLM version, packages, kernels) and renders, from that file and the hand-kept ``plugins/FAMILY/vllm_coverage.toml``
(kernel id -> ``op``, ``reason`` or ``gap``, see :func:`entry_problems`), the table between the README's coverage
markers; it exits 1, naming them, when kernels lack a valid entry. ``tests/test_vllm_coverage.py`` checks the
committed files and tables, ``tests/engines/test_vllm_coverage_source.py`` the committed kernel lists against the
installed vLLM. Rendering needs neither vLLM nor Triton.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[1]
#: plugin folder -> the name prefixes of its vLLM model packages (``vllm/models/PREFIX*``).
FAMILIES: dict[str, tuple[str, ...]] = {"deepseek_v4": ("deepseek_v4",), "kimi_k3": ("kimi_k3",)}
START, END = "<!-- vllm-coverage:start -->", "<!-- vllm-coverage:end -->"
#: The reasons a kernel may have instead of an op (``reason = "KIND: text"`` in the mapping).
REASON_KINDS: dict[str, str] = {
    "other-dsl": "another DSL is the primary path on that platform; says whether the Triton fallback is warmed",
    "dead": "never launched for these models; names the call site that shows it",
    "training-only": "launched only by a backward pass",
    "not-launched": "launched only on a platform or backend these plugins do not target; says which",
    "device-function": "a @triton.jit helper inlined into the kernels that call it, never launched alone",
}
_DECORATORS = {"jit", "autotune", "heuristics"}


def vllm_dir() -> Path:
    """The installed vLLM's package directory, found without importing vLLM.

    :raises SystemExit: when vLLM is not installed in this interpreter.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vLLM is not installed here: run this with a vLLM venv's python")
    return Path(next(iter(spec.submodule_search_locations)))


def _triton_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The local names bound to Triton modules (``triton``, ``tl``, ...) and to ``triton.jit`` itself."""
    modules, jits = {"triton", "tl"}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("triton", "triton.language"):
            jits |= {a.asname or a.name for a in node.names if a.name == "jit"}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.asname and a.name.split(".")[0] == "triton"}
    return modules, jits


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, modules: set[str], jits: set[str]) -> bool:
    """Whether a function is decorated ``TRITON.jit`` / ``.autotune`` / ``.heuristics`` or with Triton's ``jit``."""
    if isinstance(node, ast.ClassDef):
        return False
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if isinstance(target, ast.Name) and target.id in jits:
            return True
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            if target.attr in _DECORATORS and target.value.id in modules:
                return True
    return False


def _kernels(tree: ast.Module, roots: set[str] | None = None) -> Iterator[str]:
    """Qualified names of the kernels in a module; with ``roots``, only inside those top-level definitions."""
    modules, jits = _triton_names(tree)

    def walk(node: ast.AST, prefix: str) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, _DEFS):
                yield from walk(child, prefix)  # top-level if / try blocks, bodies of statements
            elif prefix or roots is None or child.name in roots:
                if _is_kernel(child, modules, jits):
                    yield prefix + child.name
                yield from walk(child, f"{prefix}{child.name}.")

    yield from walk(tree, "")


def _module_file(vllm: Path, dotted: str) -> Path | None:
    parts = dotted.split(".")
    if parts[0] != "vllm":
        return None
    base = vllm.joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _absolute(module: str | None, level: int, path: Path, vllm: Path) -> str:
    if not level:
        return module or ""
    package = ["vllm", *path.relative_to(vllm).parent.parts]
    package = package[: len(package) - level + 1]
    return ".".join(package + ([module] if module else []))


def _attributes(tree: ast.Module, chain: str) -> set[str]:
    """The attribute names read on ``chain`` (a local name or dotted module path) in a module."""
    return {
        node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and ast.unparse(node.value) == chain
    }


def _reexported(vllm: Path, path: Path, name: str) -> tuple[Path, set[str]]:
    """Where a package's ``__init__`` takes ``name`` from (its re-exports are the package's facade, not a
    level of their own); ``path`` itself for a name it defines."""
    while path.name == "__init__.py":
        tree = ast.parse(path.read_text())
        found = [
            (_absolute(n.module, n.level, path, vllm), a.name)
            for n in tree.body
            if isinstance(n, ast.ImportFrom)
            for a in n.names
            if (a.asname or a.name) == name
        ]
        source = _module_file(vllm, found[0][0]) if found else None
        if source is None:
            break
        path, name = source, found[0][1]
    return path, {name}


def _imports(path: Path, vllm: Path) -> Iterator[tuple[Path, set[str]]]:
    """(vLLM module file, names of it used) for each import of a vLLM module in ``path``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level, path, vllm)
            target = _module_file(vllm, module)
            for alias in node.names:
                sub = _module_file(vllm, f"{module}.{alias.name}")
                if sub is not None:
                    yield sub, _attributes(tree, alias.asname or alias.name)
                elif target is not None:
                    yield _reexported(vllm, target, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                target = _module_file(vllm, alias.name)
                if target is not None:
                    yield target, _attributes(tree, alias.asname or alias.name)


def _definitions(tree: ast.Module) -> dict[str, list[ast.stmt]]:
    """Top-level name -> the statements that bind it (also inside top-level ``if``/``try``/``with`` blocks)."""
    defs: dict[str, list[ast.stmt]] = {}

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, _DEFS):
                defs.setdefault(stmt.name, []).append(stmt)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for name in (n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)):
                    defs.setdefault(name.id, []).append(stmt)
            else:
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(stmt, field, []))
                for handler in getattr(stmt, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return defs


def _reachable(tree: ast.Module, names: set[str]) -> set[str]:
    """The top-level names of a module that ``names`` reach through the names their definitions read."""
    defs = _definitions(tree)
    seen, todo = set(), [n for n in names if n in defs]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for stmt in defs[name]:
            todo += [n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id in defs and n.id not in seen]
    return seen


def model_packages(vllm: Path, prefixes: tuple[str, ...]) -> list[Path]:
    """vLLM's model packages of one family: the folders ``models/PREFIX*``, sorted."""
    return sorted(p for p in (vllm / "models").iterdir() if p.is_dir() and p.name.startswith(prefixes))


def list_kernels(vllm: Path, prefixes: tuple[str, ...]) -> list[str]:
    """Every Triton kernel of vLLM's model packages ``models/PREFIX*`` and of the shared code they import.

    :param vllm: vLLM's package directory (:func:`vllm_dir`).
    :param prefixes: the package name prefixes of one family (:data:`FAMILIES`).
    :returns: sorted kernel ids, ``relative/path.py:qualified_name``.
    """
    packages = model_packages(vllm, prefixes)
    own = [f for p in packages for f in sorted(p.rglob("*.py"))]
    used: dict[Path, set[str]] = {}
    for path in own:
        for target, names in _imports(path, vllm):
            if not any(target.is_relative_to(p) for p in packages):
                used.setdefault(target, set()).update(names)
    ids = set()
    for path in own:
        ids |= {f"{path.relative_to(vllm).as_posix()}:{k}" for k in _kernels(ast.parse(path.read_text()))}
    for path, names in used.items():
        tree = ast.parse(path.read_text())
        roots = _reachable(tree, names)
        ids |= {f"{path.relative_to(vllm).as_posix()}:{k}" for k in _kernels(tree, roots)}
    return sorted(ids)


def load_mapping(family: str, root: Path = ROOT) -> dict[str, dict[str, Any]]:
    """The hand-kept mapping of a family: kernel id -> its entry (``op``, ``reason`` or ``gap``, maybe ``note``)."""
    return dict(tomllib.loads((root / "plugins" / family / "vllm_coverage.toml").read_text())["kernels"])


def load_kernels(family: str, root: Path = ROOT) -> dict[str, Any]:
    """The committed kernel list of a family (``vllm_kernels.json``: ``vllm``, ``packages``, ``kernels``)."""
    return json.loads((root / "plugins" / family / "vllm_kernels.json").read_text())


def entry_problems(kernel: str, entry: Mapping[str, Any] | None) -> list[str]:
    """What is wrong with one kernel's mapping entry, as sentences naming the kernel (empty: nothing).

    An entry has exactly one of ``op`` (a non-empty name), ``reason`` (``"KIND: text"`` with a kind of
    :data:`REASON_KINDS` and a non-empty text) or ``gap`` (``37``), and may have a non-empty ``note``.
    """
    if entry is None:
        return [f"{kernel}: not in the mapping (add op, reason or gap = 37)"]
    kinds = [k for k in ("op", "reason", "gap") if k in entry]
    problems = [f"{kernel}: unknown key {k!r}" for k in entry if k not in ("op", "reason", "gap", "note")]
    if len(kinds) != 1:
        return [*problems, f"{kernel}: needs exactly one of op, reason, gap (got {kinds or 'none'})"]
    value = entry[kinds[0]]
    if kinds[0] == "op" and not (isinstance(value, str) and value):
        problems.append(f"{kernel}: op must be a non-empty op name (got {value!r})")
    elif kinds[0] == "gap" and value != 37:
        problems.append(f"{kernel}: gap must be 37, the issue that lists the missing ops (got {value!r})")
    elif kinds[0] == "reason":
        kind, _, text = str(value).partition(": ")
        if kind not in REASON_KINDS or not text.strip():
            problems.append(
                f"{kernel}: reason must be 'KIND: text' with KIND one of {sorted(REASON_KINDS)} (got {value!r})"
            )
    if "note" in entry and not (isinstance(entry["note"], str) and entry["note"].strip()):
        problems.append(f"{kernel}: note must be non-empty text")
    return problems


def counts(kernels: list[str], mapping: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """How many kernels have an op, a reason of each kind, a gap, and no valid entry (``unmapped``)."""
    out = {"covered": 0, **{f"reason:{k}": 0 for k in REASON_KINDS}, "gaps": 0, "unmapped": 0}
    for kernel in kernels:
        entry = mapping.get(kernel)
        if entry_problems(kernel, entry):
            out["unmapped"] += 1
        elif "op" in entry:  # type: ignore[operator]
            out["covered"] += 1
        elif "gap" in entry:  # type: ignore[operator]
            out["gaps"] += 1
        else:
            out[f"reason:{entry['reason'].partition(': ')[0]}"] += 1  # type: ignore[index]
    return out


def _cell(kernel: str, entry: Mapping[str, Any] | None) -> str:
    if entry_problems(kernel, entry):
        return "**unmapped** (fix `vllm_coverage.toml`)"
    assert entry is not None
    note = f"; {entry['note']}" if "note" in entry else ""
    if "op" in entry:
        return f"`{entry['op']}`{note}"
    if "gap" in entry:
        return f"**gap** (issue 37){': ' + entry['note'] if 'note' in entry else ''}"
    kind, _, text = entry["reason"].partition(": ")
    return f"{kind}: {text}{note}"


def render(family: str, root: Path = ROOT) -> str:
    """The coverage section's generated part for a family, from its committed kernel list and mapping."""
    listed, mapping = load_kernels(family, root), load_mapping(family, root)
    kernels = listed["kernels"]
    n = counts(kernels, mapping)
    reasons = ", ".join(f"{k} {n[f'reason:{k}']}" for k in REASON_KINDS if n[f"reason:{k}"])
    lines = [
        f"vLLM {listed['vllm']}, packages {', '.join(f'`{p}`' for p in listed['packages'])} and the shared code they "
        f"import: {len(kernels)} Triton kernels; {n['covered']} covered by an op, "
        f"{sum(n[f'reason:{k}'] for k in REASON_KINDS)} with a reason ({reasons}), {n['gaps']} gaps (issue 37)"
        + (f", **{n['unmapped']} unmapped**." if n["unmapped"] else "."),
        "",
        "| kernel | vLLM file | warmreg op, or why none |",
        "|---|---|---|",
    ]
    for kernel in kernels:
        path, _, name = kernel.partition(":")
        lines.append(f"| `{name}` | `{path}` | {_cell(kernel, mapping.get(kernel)).replace('|', '/')} |")
    return "\n".join(lines)


def update_readme(family: str, root: Path = ROOT) -> None:
    """Replace the text between the coverage markers of ``plugins/FAMILY/README.md`` with :func:`render`'s.

    :raises SystemExit: when the README lacks the markers.
    """
    readme = root / "plugins" / family / "README.md"
    head, start, rest = readme.read_text().partition(START)
    _, end, tail = rest.partition(END)
    if not (start and end):
        raise SystemExit(f"{readme} lacks the markers {START} ... {END}: add them where the table belongs")
    readme.write_text(f"{head}{START}\n{render(family, root)}\n{END}{tail}")


def main() -> int:
    """List the installed vLLM's kernels of every family, write the kernel lists and the README tables.

    :returns: 1 when a kernel has no valid mapping entry (listed on stderr), else 0.
    """
    vllm, version = vllm_dir(), importlib.metadata.version("vllm")
    status = 0
    for family, prefixes in FAMILIES.items():
        packages = [p.relative_to(vllm).as_posix() for p in model_packages(vllm, prefixes)]
        kernels = list_kernels(vllm, prefixes)
        listed = {"vllm": version, "packages": packages, "kernels": kernels}
        (ROOT / "plugins" / family / "vllm_kernels.json").write_text(json.dumps(listed, indent=1) + "\n")
        update_readme(family)
        mapping = load_mapping(family)
        problems = [p for k in kernels for p in entry_problems(k, mapping.get(k))]
        problems += [f"{k}: mapped but not a kernel of vLLM {version}" for k in sorted(set(mapping) - set(kernels))]
        print(f"{family}: {len(kernels)} kernels, {counts(kernels, mapping)}")
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        status |= bool(problems)
    return status


if __name__ == "__main__":
    sys.exit(main())
