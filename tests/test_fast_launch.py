"""The guarded fast launch (warmreg.runtime.fast) against Triton 3.6.0's own specialization.

On the CPU the guards are checked against Triton's binder (the code ``JITFunction.run`` specializes
with) under a cross-target driver, with a recording stand-in for the compiled kernel's launcher, which
exists only on a GPU. On a GPU the real path is checked end to end.
"""

from __future__ import annotations

import gc
import itertools
from typing import Any

import pytest
import torch
import triton
import triton.language as tl

import warmreg
from warmreg import _triton
from warmreg.runtime import fast as _triton_fast
from warmreg.values.platform import Platform

H100 = Platform.parse("cuda:90")

_GLOBAL_SCALE: tl.constexpr = tl.constexpr(2)


@triton.jit(do_not_specialize=["loose_n"], do_not_specialize_on_alignment=["loose_ptr"])
def _probe(x_ptr, y_ptr, loose_ptr, n, loose_n, scale, flag, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if flag:
        x = x * scale
    tl.store(y_ptr + offs, x + tl.load(loose_ptr) + loose_n, mask=offs < n)


@triton.jit
def _annotated(x_ptr, stride: tl.int64, n: tl.int32, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs * stride, offs, mask=offs < n)


@triton.jit
def _reads_global(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * _GLOBAL_SCALE)


class _Recorder:
    """Stands in for a CompiledKernel: records what the launcher is called with."""

    function, packed_metadata = "fn", (4, 1, 0)

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def run(self, *args: Any) -> None:
        self.calls.append(args)


def _tensor(dtype: torch.dtype, offset: int) -> torch.Tensor:
    return torch.zeros(64, dtype=dtype)[offset:]


def _kwargs(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        x_ptr=_tensor(torch.float32, 0), y_ptr=_tensor(torch.float32, 0), loose_ptr=_tensor(torch.float32, 0),
        n=32, loose_n=32, scale=0.5, flag=True, BLOCK=64,
    )  # fmt: skip
    base.update(over)
    return base


def _specialization(jit: Any, kwargs: dict[str, Any]) -> list[Any]:
    device = _triton.current_device()
    return jit.device_caches[device][4](**kwargs, num_warps=4)[1]


def test_guards_accept_exactly_the_launches_triton_specializes_the_same_way() -> None:
    variants: dict[str, list[Any]] = {
        "x_ptr": [_tensor(torch.float32, 0), _tensor(torch.float32, 1), _tensor(torch.float32, 4), _tensor(torch.float16, 0), _tensor(torch.bfloat16, 8)],
        "y_ptr": [_tensor(torch.float32, 0), _tensor(torch.float32, 2)],
        "loose_ptr": [_tensor(torch.float32, 0), _tensor(torch.float32, 3), _tensor(torch.int32, 0)],
        "n": [0, 1, 16, 17, 32, -16, -1, 2**31 - 16, 2**31, 2**31 + 1, 2**63, 2**63 + 16, -(2**40)],
        "loose_n": [0, 1, 16, 17, 2**31],
        "scale": [0.5, 2.0, 3],
        "flag": [True, False],
        "BLOCK": [64, 128],
    }  # fmt: skip
    with _triton.cross_target(H100):
        device = _triton.current_device()
        for base_n, base_loose in [(32, 32), (17, 1), (2**31 + 16, 5)]:
            base = _kwargs(n=base_n, loose_n=base_loose)
            want = _specialization(_probe, base)
            rec = _Recorder()
            entry = _triton_fast.build(_probe, base, {"num_warps": 4}, rec, device)
            assert entry is not None
            assert entry.launch((3,), base) is True
            checked = agreed = 0
            for name, values in variants.items():
                for value in values:
                    kw = {**base, name: value}
                    same = _specialization(_probe, kw) == want
                    assert entry.launch((3,), kw) is same, (name, value, entry.source)
                    checked += 1
                    agreed += same
            assert 0 < agreed < checked
            g0, g1, g2, stream, fn, packed, meta, enter, leave, *args = rec.calls[-1]
            assert (g0, g1, g2, stream) == (3, 1, 1, 0) and (fn, packed) == ("fn", (4, 1, 0)) and (meta, enter, leave) == (None, None, None)
            assert args == [base[p.name] for p in _probe.params]


def test_annotated_int_parameters_are_guarded_as_triton_keys_them() -> None:
    """``stride: tl.int64`` keeps its type whatever the value (so 16 is an i64, not an i32), and Triton keys
    its value class from the annotation's own specialization (1 stays distinct)."""
    values = [0, 1, 2, 16, 17, 32, 2**31, 2**31 + 1, 2**40, -16, -1]
    with _triton.cross_target(H100):
        device = _triton.current_device()
        for base_stride, base_n in itertools.product([1, 16, 17, 2**33], [1, 16, 17]):
            base = dict(x_ptr=_tensor(torch.float32, 0), stride=base_stride, n=base_n, BLOCK=64)
            want = _specialization(_annotated, base)
            entry = _triton_fast.build(_annotated, base, {"num_warps": 4}, _Recorder(), device)
            assert entry is not None and entry.launch((1,), base) is True, (base, entry and entry.source)
            for name, bits in (("stride", 64), ("n", 32)):
                for value in values:
                    kw = {**base, name: value}
                    same = _specialization(_annotated, kw) == want
                    if -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
                        assert entry.launch((1,), kw) is same, (base, name, value, entry.source)
                    else:  # Triton's key ignores that the annotation cannot hold it; the guard takes Triton's path
                        assert entry.launch((1,), kw) is False, (base, name, value)


def test_keys_that_differ_only_in_alignment_share_one_source() -> None:
    """A warm builds an entry per key; compiling each one's source was most of that (52 sources for
    the Flash example's 73 keys): alignment is bound as a value, so those keys share the code."""
    with _triton.cross_target(H100):
        device = _triton.current_device()
        a = _kwargs(n=32, x_ptr=_tensor(torch.float32, 0))
        b = _kwargs(n=17, x_ptr=_tensor(torch.float32, 1))
        assert _specialization(_probe, a) != _specialization(_probe, b)
        ea, eb = (_triton_fast.build(_probe, kw, {"num_warps": 4}, _Recorder(), device) for kw in (a, b))
        assert ea is not None and eb is not None and ea.source == eb.source
        assert ea.python.__code__ is eb.python.__code__
        assert ea.launch((1,), a) and eb.launch((1,), b) and not ea.launch((1,), b) and not eb.launch((1,), a)


def test_pairs_of_changes_never_slip_through() -> None:
    """Two changes at once (e.g. dtype and alignment) still fail the guard unless Triton agrees."""
    with _triton.cross_target(H100):
        base = _kwargs()
        want = _specialization(_probe, base)
        entry = _triton_fast.build(_probe, base, {"num_warps": 4}, _Recorder(), _triton.current_device())
        assert entry is not None
        pool = [("x_ptr", _tensor(torch.float16, 1)), ("x_ptr", _tensor(torch.float32, 2)), ("n", 33), ("n", 1),
                ("flag", False), ("scale", 1), ("loose_n", 1), ("BLOCK", 32)]  # fmt: skip
        for (a, va), (b, vb) in itertools.combinations(pool, 2):
            kw = {**base, a: va, b: vb}
            assert entry.launch((1,), kw) is (_specialization(_probe, kw) == want)


def test_a_changed_call_shape_device_or_hook_takes_tritons_path() -> None:
    with _triton.cross_target(H100):
        device = _triton.current_device()
        base = _kwargs()
        rec = _Recorder()
        entry = _triton_fast.build(_probe, base, {"num_warps": 4}, rec, device)
        assert entry is not None
        assert entry.launch((1, 2), base)
        assert rec.calls[-1][:3] == (1, 2, 1)
        assert not entry.launch((1,), {k: v for k, v in base.items() if k != "flag"})
        assert not entry.launch((1,), {**base, "extra": 1})
        other = _triton_fast.build(_probe, base, {"num_warps": 4}, rec, device + 1)
        assert other is not None and not other.launch((1,), base)
        saved = triton.knobs.runtime.debug
        triton.knobs.runtime.debug = True  # part of Triton's key: a debug build is another binary
        try:
            assert not entry.launch((1,), base)
        finally:
            triton.knobs.runtime.debug = saved
        assert entry.launch((1,), base)
        hook = lambda metadata: None  # noqa: E731
        triton.knobs.runtime.launch_enter_hook.add(hook)
        try:
            assert not entry.launch((1,), base)
        finally:
            triton.knobs.runtime.launch_enter_hook.remove(hook)
        assert entry.launch((1,), base)


def test_a_changed_global_takes_tritons_path() -> None:
    global _GLOBAL_SCALE
    with _triton.cross_target(H100):
        kw = {"x_ptr": _tensor(torch.float32, 0), "BLOCK": 16}
        _reads_global.warmup(grid=(1,), **kw)  # records the globals the kernel reads
        entry = _triton_fast.build(_reads_global, kw, {}, _Recorder(), _triton.current_device())
        assert entry is not None and entry.launch((1,), kw)
        saved = _GLOBAL_SCALE
        _GLOBAL_SCALE = tl.constexpr(3)
        try:
            assert not entry.launch((1,), kw)
        finally:
            _GLOBAL_SCALE = saved
        assert entry.launch((1,), kw)


def test_arguments_without_a_cheap_guard_get_no_fast_path() -> None:
    with _triton.cross_target(H100):
        kw = _kwargs(scale=(1.0, 2.0))
        assert _triton_fast.build(_probe, kw, {"num_warps": 4}, _Recorder(), _triton.current_device()) is None


@pytest.mark.gpu
def test_gpu_second_launch_is_fast_and_correct(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.jit import JITFunction

    from warmreg.ops import FusedQKVRMSNorm, fused_qkv_rmsnorm_reference

    op = FusedQKVRMSNorm(q_size=96, kv_size=64, proj_width=160)
    dev = torch.device("cuda")
    proj = torch.randn(5, 160, device=dev, dtype=torch.bfloat16)
    qw = torch.rand(96, device=dev, dtype=torch.bfloat16) + 0.5
    kvw = torch.rand(64, device=dev, dtype=torch.bfloat16) + 0.5
    runs: list[int] = []
    real_run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: runs.append(1) or real_run(self, *a, **k))
    for step in range(3):
        x = proj * (step + 1)
        q, kv = op(x[:, :96], x[:, 96:], qw, kvw, 1e-6)
        q_ref, kv_ref = fused_qkv_rmsnorm_reference(x[:, :96], x[:, 96:], qw, kvw, 1e-6)
        torch.testing.assert_close(q, q_ref, atol=0, rtol=2**-7)
        torch.testing.assert_close(kv, kv_ref, atol=0, rtol=2**-7)
    assert len(runs) == 1  # only the first launch went through JITFunction.run
    shifted = torch.randn(5 * 160 + 1, device=dev, dtype=torch.bfloat16)[1:].view(5, 160)
    q, _ = op(shifted[:, :96], shifted[:, 96:], qw, kvw, 1e-6)  # another key: Triton's path again
    torch.testing.assert_close(q, fused_qkv_rmsnorm_reference(shifted[:, :96], shifted[:, 96:], qw, kvw, 1e-6)[0], atol=0, rtol=2**-7)
    assert len(runs) == 2
    with warmreg.monitor("error") as mon:  # armed: the fast path still serves, and every launch is counted
        op(proj[:, :96], proj[:, 96:], qw, kvw, 1e-6)
        op(shifted[:, :96], shifted[:, 96:], qw, kvw, 1e-6)
    assert len(runs) == 2 and not mon.misses
    assert sum(row["launches"] for row in mon.counters().values()) == 2, mon.counters()


class _Capture:
    def __init__(self) -> None:
        self.spec: Any = None

    def capture(self, kernel: Any, spec: Any) -> None:
        self.spec = spec


@pytest.mark.parametrize("config", ["deepseek_v4_flash", "deepseek_v4_pro", "kimi_k3"])
def test_every_planned_key_gets_a_fast_path(config: str) -> None:
    """Each key of the example configs: the guard built from its launch accepts that launch again."""
    from pathlib import Path

    from warmreg.runtime.launch import WARM_SESSION

    plan = warmreg.plan(Path(__file__).parents[1] / "examples" / f"{config}.json", target="cuda:90")
    missing = []
    with _triton.cross_target(plan.platform):
        for kp, key in plan.items():
            kernel = kp.kernel_for(key)
            session = _Capture()
            token = WARM_SESSION.set(session)
            try:
                kernel.launch_for_warm(key)
            finally:
                WARM_SESSION.reset(token)
            spec = session.spec
            jit = kernel.jit_for(key)
            entry = _triton_fast.build(jit, spec.kwargs, key.launch_options(), _Recorder(), _triton.current_device())
            if entry is None or not entry.launch(spec.grid or (1,), spec.kwargs):
                missing.append(f"{kp.name}: {key}")
    assert not missing, missing


@pytest.mark.gpu
def test_gpu_warm_prepares_fast_launches_so_even_a_first_launch_skips_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime.jit import JITFunction

    from tests.helpers import CONFIG, Plugin, Scale
    from warmreg.runtime.launch import FAST_TABLES

    scale = Scale()
    report = warmreg.warm(CONFIG, plugins=[Plugin(scale)], entry_points=False)
    assert len(FAST_TABLES[scale.name]) == report.declared == 3
    runs: list[int] = []
    real_run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: runs.append(1) or real_run(self, *a, **k))
    x = torch.randn(48, device="cuda", dtype=torch.float16)  # the warmed key of size 16 (div16, fp16)
    with warmreg.monitor("error") as mon:
        out = Scale()(x, 2.0)  # another instance under the same name: the same kernel
    torch.testing.assert_close(out, x * 2.0)
    assert runs == [] and not mon.misses


@pytest.mark.gpu
def test_gpu_no_launch_from_an_unloaded_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton frees a kernel by dropping its ``CompiledKernel`` (its ``device_caches`` cleared, as
    ``JITFunction`` does when it is redefined); from 3.8 that unloads the module. A warmed entry holds
    its ``CompiledKernel``, so the module stays loaded and the fast path still launches it; once the
    entry goes too, Triton really unloads it (the check can fail)."""
    import gc

    from triton.runtime.jit import JITFunction

    from tests.helpers import CONFIG, Plugin, Scale
    from warmreg.runtime.launch import FAST_TABLES

    unloaded: list[Any] = []
    chain = getattr(triton.knobs.runtime, "kernel_unload_hook", None)  # 3.8+: called before an unload

    def record(module: Any, function: Any, name: str, group: Any, hash: str) -> None:
        unloaded.append(module)

    if chain is not None:
        chain.add(record)
    try:
        scale = Scale()
        FAST_TABLES.pop(scale.name, None)
        warmreg.warm(CONFIG, plugins=[Plugin(scale)], entry_points=False)
        x = torch.randn(48, device="cuda", dtype=torch.float16)
        key = scale.dispatch(x=x, block=64)
        entry = FAST_TABLES[scale.name][key]
        module = entry.compiled.module
        assert module is not None
        for caches in scale.jit.device_caches.values():  # Triton's references to every kernel of this jit
            caches[0].clear()
        gc.collect()
        assert module not in unloaded and entry.compiled.module == module
        runs: list[int] = []
        real_run = JITFunction.run
        with pytest.MonkeyPatch.context() as mp:  # its own context: the test's monkeypatch holds the isolated cache
            mp.setattr(JITFunction, "run", lambda self, *a, **k: runs.append(1) or real_run(self, *a, **k))
            out = Scale()(x, 3.0)
            torch.cuda.synchronize()
        torch.testing.assert_close(out, x * 3.0)
        assert runs == []  # launched from the entry, not recompiled or reloaded by Triton
        if chain is not None:
            del FAST_TABLES[scale.name], entry
            gc.collect()
            assert module in unloaded  # nothing else held it: without the entry's reference it is gone
    finally:
        if chain is not None:
            chain.remove(record)


def test_an_entry_serves_only_the_jit_function_it_was_built_from() -> None:
    """A kernel whose ``jit_for(key)`` differs from the entry's jit (two instances under one name
    that disagree, against the contract) takes Triton's path instead of the other binary."""
    from tests.helpers import Scale, _scale_kernel
    from warmreg.runtime.launch import FAST_TABLES

    launched: list[tuple[int, ...]] = []
    x = torch.arange(16, dtype=torch.float16)
    key = Scale().dispatch(x=x, block=64)
    stand_in = _triton_fast.FastLaunch(lambda: ("", lambda grid, kw: launched.append(grid) or True), 0, jit=_scale_kernel)
    FAST_TABLES.setdefault(Scale.name, {})[key] = stand_in
    Scale()(x, 2.0)
    assert launched == [(1,)]  # the entry's own jit: served by the entry

    class Disagreeing(Scale):
        name = Scale.name
        jit = triton.jit(_scale_kernel.fn)  # the same source, another JITFunction: not the entry's binary

    out = Disagreeing()(x, 2.0)
    assert launched == [(1,)]  # not served by the entry
    torch.testing.assert_close(out, x * 2.0)  # Triton's path (interpreted on the CPU) ran it
    # gone before the next test: a live kernel class is what a pack install looks its function up in
    # (warmreg.stages.pack.loaded_jits), and this one's has the full name of helpers' own _scale_kernel
    del Disagreeing
    gc.collect()
