"""The JIT monitor with real Triton compile events (cross-compiling for cuda:90 on the CPU)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
import triton.language as tl

import warmreg
from tests.helpers import CONFIG, Plugin, Scale
from warmreg import _triton
from warmreg.values.platform import Platform

H100 = Platform.parse("cuda:90")


def _warm(*sizes: int) -> Scale:
    kernel = Scale(sizes=sizes)
    warmreg.warm(CONFIG, target=H100, plugins=[Plugin(kernel)], entry_points=False, workers=1)
    return kernel


#: What a launch on the cross target ends in once it got past binding and compiling: the stand-in
#: driver has no launcher to run the binary.
NO_LAUNCHER = AttributeError


def _runtime_launch(kernel: Scale, x: torch.Tensor) -> Any:
    """A launch through the kernel's own launch code, as a server would do it, on the cross target.

    With meta tensors Triton binds, specializes and (if needed) compiles exactly as on a GPU; the
    stand-in driver cannot run the binary, so a launch that got past the compile fails after it.
    """
    with _triton.cross_target(H100):
        return kernel(x, 2.0)


def test_compile_inside_warmup_is_allowed_outside_is_refused_before_compiling(triton_cache: Path) -> None:
    with warmreg.monitor("error") as mon:
        kernel = _warm(16)  # compiles inside warm: allowed
        assert mon.misses == []
        before = sorted(p.name for p in triton_cache.iterdir())
        with pytest.raises(warmreg.JitMissError) as info:
            _runtime_launch(kernel, warmreg.meta((17,), torch.float16))  # n=17: the "other" class, never warmed
        assert sorted(p.name for p in triton_cache.iterdir()) == before  # refused before compiling: nothing written
    miss = info.value.miss
    assert miss.kernel == "tests.scale" and miss.kind == "compile"
    assert "n_class: 'div16' != 'other'" in miss.diff
    assert any(d.startswith("n: warmed ('i32', 'D') != runtime ('i32', '')") for d in miss.triton_diff)
    assert "tests.scale" in str(info.value) and "fix:" in str(info.value)


def test_warmed_shapes_do_not_miss() -> None:
    kernel = _warm(16, 17, 1)
    with warmreg.monitor("error") as mon:
        for n in (16, 32, 4096, 17, 33, 1):
            with pytest.raises(NO_LAUNCHER, match="launcher_cls"):  # found in memory; only the launch fails
                _runtime_launch(kernel, warmreg.meta((n,), torch.float16))
    assert mon.misses == [] and mon.counters()["tests.scale"]["launches"] == 6
    assert mon.used_keys("tests.scale") and len(mon.used_keys("tests.scale")) == 3


def test_miss_explanations_name_the_differing_field() -> None:
    kernel = _warm(16)
    with warmreg.monitor("record") as mon:
        for x in (warmreg.meta((1,), torch.float16), warmreg.meta((32,), torch.float16, offset=1)):
            with pytest.raises(NO_LAUNCHER):
                _runtime_launch(kernel, x)
    one, unaligned = mon.misses
    assert "n_class: 'div16' != 'one'" in one.diff  # the int class of T=1
    assert one.diff and any("constexpr" in d for d in one.triton_diff)
    assert unaligned.diff == ("aligned: True != False",)  # alignment of an offset view
    assert mon.counters()["tests.scale"]["misses"] == 2


def test_unregistered_kernel_is_reported_as_such() -> None:
    from tests.helpers import _scale_kernel

    with warmreg.monitor("record") as mon, _triton.cross_target(H100):
        x = warmreg.meta((64,), torch.bfloat16)
        _scale_kernel.warmup(x, x, 64, 1.0, BLOCK=64, grid=(1,))
    (miss,) = mon.misses
    assert miss.kernel is None and "unregistered" in miss.explain() and "register this kernel" in miss.explain()


def test_record_then_replay_round_trip(tmp_path: Path, triton_cache: Path) -> None:
    kernel = _warm(16)
    record = tmp_path / "misses.jsonl"
    with warmreg.monitor("record", record=record):
        with pytest.raises(NO_LAUNCHER):
            _runtime_launch(kernel, warmreg.meta((17,), torch.float16))
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["kernel"] == "tests.scale" and lines[0]["specialization_data"]
    _triton.forget_compiled()
    for p in triton_cache.iterdir():  # an empty cache: replay must really compile
        __import__("shutil").rmtree(p)
    from warmreg.monitoring.replay import replay

    (skipped,) = replay(record)  # recorded on a machine without a GPU: no target in the record
    assert not skipped.ok and skipped.skipped and "pass --target" in skipped.skipped and not list(triton_cache.rglob("*.cubin"))
    results = replay(record, target="cuda:90")
    assert [r.ok for r in results] == [True]
    assert list(triton_cache.rglob("*.cubin"))


def test_hooks_installed_by_someone_else_survive_arm_and_disarm() -> None:
    calls: list[str] = []

    def theirs(**kwargs: Any) -> None:
        calls.append(kwargs["key"])

    def their_load(*args: Any) -> None:
        pass

    triton.knobs.runtime.jit_cache_hook = theirs
    triton.knobs.runtime.kernel_load_start_hook.add(their_load)
    try:
        kernel = _warm(16)
        with warmreg.monitor("warn"), pytest.warns(RuntimeWarning, match="tests.scale"):
            with pytest.raises(NO_LAUNCHER):
                _runtime_launch(kernel, warmreg.meta((17,), torch.float16))
        assert calls  # chained: their hook still ran
        assert triton.knobs.runtime.jit_cache_hook is theirs
        assert triton.knobs.runtime.kernel_load_start_hook.calls == [their_load]
    finally:
        triton.knobs.runtime.jit_cache_hook = None
        triton.knobs.runtime.kernel_load_start_hook.remove(their_load)


def test_nested_contexts_and_exceptions_restore_everything() -> None:
    assert triton.knobs.runtime.jit_cache_hook is None
    with pytest.raises(ZeroDivisionError):
        with warmreg.monitor("record") as outer:
            with warmreg.monitor("error") as inner:
                assert _current() is inner
            assert _current() is outer
            raise ZeroDivisionError
    assert _current() is None and triton.knobs.runtime.jit_cache_hook is None


def _current() -> Any:
    from warmreg.monitoring import current

    return current()


def test_warm_scope_is_per_thread() -> None:
    """A thread warming while another serves: only the serving thread's compile is a miss."""
    kernel = _warm(16)
    errors: list[BaseException] = []
    with warmreg.monitor("record") as mon:

        def serve() -> None:
            try:
                _runtime_launch(kernel, warmreg.meta((17,), torch.float16))
            except NO_LAUNCHER as exc:  # the stand-in driver cannot launch
                errors.append(exc)

        t = threading.Thread(target=serve)
        t.start()
        warmreg.warm(CONFIG, target=H100, plugins=[Plugin(Scale(sizes=(1,)))], entry_points=False, workers=2)
        t.join()
    assert [m.runtime_key.n_class for m in mon.misses] == ["other"]  # type: ignore[union-attr]


def test_warm_arms_the_monitor_when_asked() -> None:
    try:
        warmreg.warm(CONFIG, target=H100, plugins=[Plugin(Scale(sizes=(16,)))], entry_points=False, monitor="error")
        assert _current() is not None and _current().mode == "error"
    finally:
        warmreg.disarm()
    assert _current() is None


def test_bad_mode() -> None:
    with pytest.raises(warmreg.WarmregError, match="mode"):
        warmreg.arm("loud")  # type: ignore[arg-type]


@triton.autotune(configs=[triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 64})], key=["n"])
@triton.jit
def _tuned_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def test_autotuner_benchmarking_after_warmup_is_a_miss() -> None:
    with warmreg.monitor("error"), _triton.cross_target(H100):
        x = warmreg.meta((64,), torch.float32)
        with pytest.raises(warmreg.JitMissError, match="autotuner benchmark"):
            _tuned_kernel[(1,)](x, 64)


def test_module_load_at_first_launch_is_a_miss() -> None:
    """Triton calls its kernel-load hooks before loading a binary onto the device (on a GPU only);
    the monitor's hook is installed there while armed and turns the call into a miss."""
    with warmreg.monitor("record") as mon:
        triton.knobs.runtime.kernel_load_start_hook(None, None, "_scale_kernel", {}, "abc")
    assert [m.kind for m in mon.misses] == ["load"] and "module load" in mon.misses[0].explain()
    with warmreg.monitor("error"), pytest.raises(warmreg.JitMissError):
        triton.knobs.runtime.kernel_load_start_hook(None, None, "_scale_kernel", {}, "abc")
    assert triton.knobs.runtime.kernel_load_start_hook.calls == []


def test_cli_report_and_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from warmreg.cli.main import main

    kernel = _warm(16)
    record = tmp_path / "misses.jsonl"
    with warmreg.monitor("record", record=record) as mon:
        with pytest.raises(NO_LAUNCHER):
            _runtime_launch(kernel, warmreg.meta((17,), torch.float16))
        with pytest.raises(NO_LAUNCHER):
            _runtime_launch(kernel, warmreg.meta((32,), torch.float16))  # warmed: a hit
    snapshot = tmp_path / "snapshot.json"
    mon.save(snapshot)
    assert main(["report", str(record)]) == 0
    assert main(["report", str(snapshot), "--require-complete"]) == 1
    assert main(["report", str(snapshot), "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out[out.index("{") :])
    (row,) = data["kernels"]
    assert row["kernel"] == "tests.scale" and row["missed"] == 1 and row["hit"] == 1 and not data["complete"]
    assert main(["replay", str(record), "--target", "cuda:90"]) == 0


def test_replay_says_what_it_skipped_and_why_and_fails_when_nothing_was_replayed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from warmreg.cli.main import main

    record = tmp_path / "misses.jsonl"
    records = [
        {"kind": "load", "jit_name": "tests.helpers._scale_kernel"},
        {"kind": "compile", "jit_name": "tests.helpers._scale_kernel", "specialization_data": "{}"},  # no target recorded
        {"kind": "compile", "jit_name": "tests.helpers._scale_kernel", "target": "cuda:90"},  # no specialization data
    ]
    record.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["replay", str(record)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "skipped tests.helpers._scale_kernel: a load miss: nothing to compile" in out
    assert "skipped tests.helpers._scale_kernel: the record names no target: pass --target, e.g. cuda:90" in out
    assert "skipped tests.helpers._scale_kernel: the record holds no specialization data" in out
    assert "0 of 3 records compiled, 0 failed, 3 skipped" in out
    record.write_text("[1, 2]\n")
    assert main(["replay", str(record)]) == 2
    assert f"{record}:1: not a warmreg miss record" in capsys.readouterr().err
