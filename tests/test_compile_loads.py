"""The compile step's module loads on the local GPU (``warmreg.pipeline.compile._loading``), without a GPU:
the adapter's load calls are replaced, so what is checked is which thread loads which key and that
every load is done, and its error kept, when the step ends."""

from __future__ import annotations

import threading
import types

import attrs
import pytest

from warmreg import _triton
from warmreg.pipeline import compile
from warmreg.values.platform import Platform


class _Task:
    def __init__(self, name: str) -> None:
        self.compiled, self.status, self.error, self.load_seconds = name, "compiled", None, 0.0

    def fail(self, error: str) -> None:  # Task.fail: a failed load keeps its error
        self.status, self.error = "failed", error


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """``{kernel: thread name}`` of every load; a kernel named ``build*`` builds a C launcher on load,
    ``fail*`` fails its load."""
    seen: dict[str, str] = {}

    def finish_load(compiled: str) -> None:
        seen[compiled] = threading.current_thread().name
        if compiled.startswith("fail"):
            raise RuntimeError("no module image")

    def builds_on_load(compiled: str) -> bool:
        return compiled.startswith("build")

    monkeypatch.setattr(_triton, "finish_load", finish_load)
    monkeypatch.setattr(_triton, "builds_on_load", builds_on_load)
    monkeypatch.setattr(_triton, "current_device", lambda: 0)
    monkeypatch.setattr(_triton, "set_device", lambda device: None)
    return seen


LOCAL = Platform("cuda", 90, local=True)
NAMES = ["hit0", "build0", "hit1", "build1", "fail0", "hit2"]


def test_a_warm_of_hits_loads_each_right_after_its_hit_and_launcher_builds_on_the_pool(loads: dict[str, str]) -> None:
    tasks = [_Task(n) for n in NAMES]
    with compile._loading(LOCAL, 4, hits=True) as load:
        for task in tasks:
            load(task)
            if not task.compiled.startswith("build"):  # loaded by the time load() returns, on the calling thread
                assert loads[task.compiled] == threading.current_thread().name
        # the builds wait for the block's end (a compile process may be building that launcher still)
        assert not [name for name in loads if name.startswith("build")]
    assert set(loads) == set(NAMES)  # every load done when the step ends
    for name in ("build0", "build1"):  # a load that runs the C compiler goes wide
        assert loads[name].startswith("warmreg-load_"), name
    failed = tasks[NAMES.index("fail0")]
    assert (failed.status, failed.error) == ("failed", "RuntimeError: no module image")
    assert all(t.status == "compiled" and t.error is None for t in tasks if t is not failed)


def test_a_warm_that_compiles_loads_every_key_on_the_pool(loads: dict[str, str]) -> None:
    tasks = [_Task(n) for n in NAMES]
    with compile._loading(LOCAL, 4, hits=False) as load:
        for task in tasks:
            load(task)
    assert set(loads) == set(NAMES)
    assert all(thread.startswith("warmreg-load_") for thread in loads.values()), loads


def test_off_the_local_gpu_nothing_is_loaded(loads: dict[str, str]) -> None:
    with compile._loading(Platform("cuda", 90), 4, hits=True) as load:
        load(_Task("hit0"))
    assert loads == {}


def test_a_failed_or_uncompiled_key_is_not_loaded(loads: dict[str, str]) -> None:
    failed, missing = _Task("hit0"), _Task("hit1")
    failed.status, missing.compiled = "failed", None
    with compile._loading(LOCAL, 2, hits=True) as load:
        load(failed)
        load(missing)
    assert loads == {}



def test_whether_a_load_builds_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = types.SimpleNamespace(target=types.SimpleNamespace(backend="cuda"))
    ast = types.SimpleNamespace(signature={"x_ptr": "*fp32"}, constants={})
    kernel = types.SimpleNamespace(module=None, src=ast, metadata=cuda)
    monkeypatch.setattr(_triton.compiler, "RELEASE", attrs.evolve(_triton.RELEASE, per_signature_launcher=False))
    assert not _triton.builds_on_load(kernel)  # Triton 3.7+: one generic launcher, nothing to build
    monkeypatch.setattr(_triton.compiler, "RELEASE", attrs.evolve(_triton.RELEASE, per_signature_launcher=True))
    built = {"yes": True}
    monkeypatch.setattr(_triton.compiler, "launcher_source", lambda compiled: ("launcher-key", "source"))
    monkeypatch.setattr(_triton.compiler, "is_built", lambda compiled, key=None: built["yes"])
    assert not _triton.builds_on_load(kernel)
    built["yes"] = False
    assert _triton.builds_on_load(kernel)
    assert not _triton.builds_on_load(None)
    assert not _triton.builds_on_load(types.SimpleNamespace(module=object(), src=ast, metadata=cuda))  # loaded already

    def lookup_fails(compiled: object, key: object = None) -> bool:
        raise KeyError("signature")

    monkeypatch.setattr(_triton.compiler, "is_built", lookup_fails)
    assert _triton.builds_on_load(kernel)  # cannot tell: the load goes wide and reports its own error
    assert _triton.builds_on_load(types.SimpleNamespace(module=None, src=object(), metadata=cuda))  # not an ASTSource
