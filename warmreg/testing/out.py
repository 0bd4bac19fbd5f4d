"""The ``out=`` conformance of an op that allocates its outputs: what :func:`warmreg.output` promises, checked.

An op takes ``out=`` so that an engine (and CUDA-graph capture) can hand it persistent buffers and a launch
allocates nothing. :func:`check_out` checks the three parts of that contract on CPU tensors (Triton's interpreter):

1. :func:`assert_out_written`: given buffers that start as garbage (NaN, 7777, ``0x7F`` bytes), the op returns
   those tensors themselves, written exactly as its fresh outputs are (so it writes every element it returns);
2. :func:`assert_out_refused`: a buffer of another dtype, shape or device, a strided or a misaligned one raises
   :class:`warmreg.LaunchError` naming it (``out``, ``out[1]``, ``out[0][1]``), and so does a tuple short of one;
3. :func:`assert_allocates_nothing`: the launch code alone (the method under ``kernel_launcher``: nothing is
   launched) calls no tensor factory when given ``out``, and does without it (the probe works).

A case is an :class:`OpCall`, built afresh for every launch by a function of no arguments (ops may update their
inputs in place). :func:`assert_every_out_checked` keeps a plugin's test suite complete: every op whose launcher
takes ``out=None`` is built into an ``OpCall`` by some test module.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import warmreg

from .reference import EXACT, Tolerance, assert_matches, leaves

__all__ = [
    "FACTORIES", "TUPLE_ERROR", "Allocations", "OpCall", "allocating_kernels", "assert_allocates_nothing",
    "assert_every_out_checked", "assert_out_is_the_buffer_keywords", "assert_out_refused", "assert_out_written",
    "bad_buffers", "check_out", "garbage_like", "garbage_out", "out_names",
]  # fmt: skip

#: What a short ``out`` tuple's error says (a regular expression).
TUPLE_ERROR = r"out must be a tuple of \d+ "
#: The tensor factories (functions and methods) :class:`Allocations` records.
FACTORIES = frozenset(
    "empty zeros ones full empty_like zeros_like ones_like full_like empty_strided tensor arange cat clone "
    "new_empty new_zeros new_ones new_full new_tensor new_empty_strided".split()
)


@dataclass(frozen=True)
class OpCall:
    """One launch of an op: the kernel, its arguments, and how its ``out=`` launch is compared.

    :param kernel: the :class:`warmreg.TritonKernel`; its ``launcher`` method is called.
    :param args: positional arguments of the launcher.
    :param kwargs: keyword arguments of the launcher (without ``out``).
    :param tol: how far the ``out=`` launch's outputs may be from the fresh launch's (float leaves); ``None``:
        not at all (the same kernel on the same inputs).
    :param masks: per output leaf, where the op writes it (``None``: everywhere), for outputs written in part.
    :param scratch: other caller buffers that come with ``out``: name to a function of the ``out`` buffers
        giving that buffer (a scratch workspace), passed with ``out`` on every launch.
    """

    kernel: Any
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    tol: Tolerance | None = None
    masks: tuple[torch.Tensor | None, ...] = ()
    scratch: Mapping[str, Callable[[Any], torch.Tensor]] = field(default_factory=dict)

    def __call__(self, **extra: Any) -> Any:
        """Launch (Triton's interpreter for CPU tensors) and return the op's outputs."""
        return getattr(self.kernel, self.kernel.launcher)(*self.args, **self.kwargs, **extra)

    def launch_code(self, **extra: Any) -> warmreg.LaunchSpec[Any]:
        """The launch code alone, the method ``kernel_launcher`` wraps: its :class:`warmreg.LaunchSpec`, nothing launched."""
        body = inspect.unwrap(getattr(type(self.kernel), self.kernel.launcher))
        return body(self.kernel, *self.args, **self.kwargs, **extra)  # type: ignore[no-any-return]

    def with_out(self, out: Any) -> dict[str, Any]:
        """``out=`` and the :attr:`scratch` buffers that come with it."""
        return {"out": out, **{name: make(out) for name, make in self.scratch.items()}}


def garbage_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh, contiguous buffer of ``t``'s shape, dtype and device holding what no kernel writes: NaN (floats),
    7777 (integers), ``0x7F`` bytes (one-byte dtypes: FP8 codes, ``uint8``, ``int8``), ``True`` (bool)."""
    buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if t.dtype == torch.bool:
        buf.fill_(True)
    elif t.dtype.itemsize == 1:
        buf.view(torch.uint8).fill_(0x7F)
    else:
        buf.fill_(float("nan") if t.dtype.is_floating_point or t.dtype.is_complex else 7777)
    return buf


def garbage_out(outputs: Any) -> Any:
    """:func:`garbage_like` buffers nested as ``outputs`` are (a tensor, ``None``, or tuples of them)."""
    if isinstance(outputs, (tuple, list)):
        return tuple(garbage_out(o) for o in outputs)
    return None if outputs is None else garbage_like(outputs)


def out_names(x: Any, name: str = "out") -> list[str]:
    """The parameter name of each leaf of ``x`` as an op's errors name it: ``out``, ``out[1]``, ``out[0][1]``."""
    if not isinstance(x, (tuple, list)):
        return [name]
    return [leaf for i, item in enumerate(x) for leaf in out_names(item, f"{name}[{i}]")]


def _replace(x: Any, index: int, value: Any) -> Any:
    """``x`` with its leaf number ``index`` (depth first) replaced by ``value``."""
    if not isinstance(x, (tuple, list)):
        return value if index == 0 else x
    items, start = [], 0
    for item in x:
        items.append(_replace(item, index - start, value) if 0 <= index - start < len(leaves(item)) else item)
        start += len(leaves(item))
    return tuple(items)


def bad_buffers(t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers like ``t`` but each wrong in one way an op must refuse: ``(what, buffer)``."""
    other = torch.float32 if t.dtype == torch.float64 else torch.float64
    shape, dev = tuple(t.shape), t.device
    yield "another dtype", torch.empty(shape, dtype=other, device=dev)
    yield "another shape", torch.empty((*shape[:-1], shape[-1] + 1) if shape else (1,), dtype=t.dtype, device=dev)
    if dev.type != "meta":
        yield "another device", torch.empty(shape, dtype=t.dtype, device="meta")
    n = t.numel()
    if n > 1 and max(shape) > 1:
        strides = torch.empty(shape, device="meta").stride()
        yield "strided", torch.empty(2 * n, dtype=t.dtype, device=dev).as_strided(shape, [2 * s for s in strides])
    if n and t.dtype.itemsize < 16:
        yield "misaligned", torch.empty(n + 1, dtype=t.dtype, device=dev)[1:].view(shape)


def assert_out_written(build: Callable[[], OpCall]) -> None:
    """With ``out`` of garbage buffers, the op returns them, each written as the fresh launch's output.

    :param build: a fresh :class:`OpCall` per call (the fresh launch may have updated its inputs).
    """
    want = build()()
    call = build()
    out = garbage_out(want)
    got = call(**call.with_out(out))
    assert len(leaves(got)) == len(leaves(out)), f"{len(leaves(got))} outputs returned, {len(leaves(out))} given"
    for name, g, o in zip(out_names(out), leaves(got), leaves(out)):
        assert g is o, f"{name} is not returned: the op returned another tensor in its place"
    assert_matches(got, want, EXACT if call.tol is None else call.tol, masks=call.masks)


def assert_out_refused(build: Callable[[], OpCall], *, tuple_error: str = TUPLE_ERROR, accepts: Iterable[str] = ()) -> None:
    """Every wrong buffer (:func:`bad_buffers`, one at a time, the others right) raises a
    :class:`warmreg.LaunchError` naming it, and a tuple short of its last buffer raises one matching ``tuple_error``.

    :param accepts: the kinds of :func:`bad_buffers` the op's contract takes (``"another dtype"`` for an op that
        stores into its ``out``'s float dtype, ``"misaligned"`` for one whose key has the buffer's alignment).
    """
    call = build()
    good = garbage_out(call())
    for i, (name, leaf) in enumerate(zip(out_names(good), leaves(good))):
        if leaf is None:
            continue
        for what, bad in bad_buffers(leaf):
            if what not in accepts:
                out: Any = _replace(good, i, bad)
                _refused(lambda out=out: call(**call.with_out(out)), rf"{re.escape(name)} is ", f"{name} of {what}")  # type: ignore[misc]
    if isinstance(good, tuple):
        _refused(lambda: call(**call.with_out(good[:-1])), tuple_error, "an out tuple short of one buffer")


def _refused(launch: Callable[[], Any], match: str, what: str) -> None:
    """``launch()`` raises a :class:`warmreg.LaunchError` whose message matches ``match``."""
    try:
        launch()
    except warmreg.LaunchError as exc:
        assert re.search(match, str(exc)), f"{what}: the LaunchError does not say {match!r}: {exc}"
    else:
        raise AssertionError(f"{what} was accepted")


class Allocations(TorchFunctionMode):
    """Records the tensor factories (:data:`FACTORIES`) called under it: what launch code allocates.

    :ivar calls: the factories' names, in call order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in FACTORIES:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def assert_allocates_nothing(call: OpCall, out: Any = None) -> warmreg.LaunchSpec[Any]:
    """The launch code alone allocates without ``out`` (the probe sees it) and nothing with it.

    :param out: the buffers to pass (persistent buffers larger than needed, views' storage); default: garbage
        like the fresh outputs, which the spec must then return themselves.
    :returns: the spec of the launch with ``out``.
    """
    with Allocations() as fresh:
        outputs = call.launch_code().outputs
    assert fresh.calls, "the launch code allocated nothing without out: the probe sees no factory"
    given = garbage_out(outputs) if out is None else out
    extra = call.with_out(given)
    with Allocations() as probe:
        spec = call.launch_code(**extra)
    assert not probe.calls, f"the launch code allocated with out given: {probe.calls}"
    assert isinstance(spec, warmreg.LaunchSpec), f"the launch code returned {type(spec).__name__}"
    if out is None:
        for name, o, b in zip(out_names(given), leaves(spec.outputs), leaves(given), strict=True):
            assert o is b, f"the spec's {name} is not the buffer given"
    return spec


def assert_out_is_the_buffer_keywords(call: OpCall, buffers: tuple[torch.Tensor, ...], names: tuple[str, ...]) -> None:
    """For an op that also takes its persistent buffers as keywords (``names``, in output order): ``out=buffers``
    writes and returns them exactly as those keywords do, refuses both at once, and names a wrong first buffer.

    :param buffers: the persistent buffers (larger than a step needs is fine); written by the check.
    """
    keyed = tuple(b.clone() for b in buffers)
    want = call(**dict(zip(names, keyed)))
    got = call(out=buffers)
    for name, g, w, b, k in zip(names, got, want, buffers, keyed, strict=True):
        assert g.data_ptr() == b.data_ptr(), f"{name}: the output is not a view of out's buffer"
        assert torch.equal(g, w) and torch.equal(b, k), f"{name}: out= and {name}= write differently"
    _refused(lambda: call(out=buffers, **{names[1]: keyed[1]}), f"out and {names[1]} are both given", f"out and {names[1]}")
    wrong = buffers[0].long() if buffers[0].dtype != torch.int64 else buffers[0].int()
    _refused(lambda: call(out=(wrong, *buffers[1:])), names[0], f"out[0] of {wrong.dtype}")


def check_out(build: Callable[[], OpCall], *, tuple_error: str = TUPLE_ERROR, accepts: Iterable[str] = ()) -> None:
    """The whole ``out=`` contract of an op whose ``out`` mirrors its outputs: :func:`assert_out_written`,
    :func:`assert_out_refused` and :func:`assert_allocates_nothing`.

    :param build: a fresh :class:`OpCall` per call.
    :param tuple_error: what a tuple short of one buffer raises (a regular expression).
    :param accepts: kinds of wrong buffer the op takes after all (see :func:`assert_out_refused`).
    """
    assert_out_written(build)
    assert_out_refused(build, tuple_error=tuple_error, accepts=accepts)
    assert_allocates_nothing(build())


def allocating_kernels(package: ModuleType) -> dict[str, str]:
    """Every kernel class defined in the modules of ``package`` whose launcher takes ``out=None``: class name ->
    kernel name. (A required ``out`` is a workspace the op writes into, not an output it would allocate.)"""
    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and issubclass(cls, warmreg.TritonKernel) and cls.__module__ == module.__name__:
                out = inspect.signature(getattr(cls, cls.launcher)).parameters.get("out")
                if out is not None and out.default is None:
                    found[name] = cls.name
    return found


def _opcall_kernels(path: Path) -> set[str]:
    """The kernel classes a test module builds an :class:`OpCall` of: ``OpCall(Kernel(...), ...)``, or through a
    module-level kernel (``KERNEL = Kernel(...)``) or a module-level function returning one."""
    tree = ast.parse(path.read_text())
    made: dict[str, ast.expr] = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    for f in tree.body:
        returns = [r.value for r in ast.walk(f) if isinstance(r, ast.Return) and r.value is not None]
        if isinstance(f, ast.FunctionDef) and returns:
            made[f.name] = returns[-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "OpCall" and node.args:
            kernel = node.args[0]
            by_name = kernel.func if isinstance(kernel, ast.Call) else kernel
            if isinstance(by_name, ast.Name) and by_name.id in made:
                kernel = made[by_name.id]
            if isinstance(kernel, ast.Call) and isinstance(kernel.func, ast.Name):
                found.add(kernel.func.id)
    return found


def assert_every_out_checked(package: ModuleType, tests: str | Path) -> dict[str, str]:
    """Every allocating kernel of the plugin ``package`` (:func:`allocating_kernels`) is built into an
    :class:`OpCall` by a ``test_*.py`` module in ``tests``, which then runs the kit's checks on it.

    :returns: the allocating kernels, class name -> kernel name (for the caller's own count).
    :raises AssertionError: naming the kernels no test module builds an ``OpCall`` of.
    """
    ops = allocating_kernels(package)
    checked = set().union(*(_opcall_kernels(p) for p in sorted(Path(tests).glob("test_*.py"))))
    missing = sorted(set(ops) - checked)
    assert not missing, f"no test module in {tests} checks out= of {missing}: build an OpCall, run check_out on it"
    return ops
