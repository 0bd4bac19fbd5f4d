"""warm(): cross-compiling real binaries on a CPU-only machine, isolation of failures, reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import warmreg
from tests.helpers import CONFIG, Broken, Plugin, Scale


def _cubins(cache: Path) -> list[Path]:
    return sorted(cache.rglob("*.cubin"))


def test_cross_compile_for_cuda90_writes_real_cubins(triton_cache: Path) -> None:
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False, workers=2)
    assert report.ok and report.declared == 3 and report.compiled == 3
    cubins = _cubins(triton_cache)
    assert len(cubins) == 3
    assert all(c.read_bytes()[:4] == b"\x7fELF" for c in cubins)  # CUDA binaries are ELF files
    meta = json.loads(next(triton_cache.rglob("_scale_kernel.json")).read_text())
    assert meta["target"]["arch"] == 90 and meta["target"]["backend"] == "cuda"


def test_second_warm_comes_from_cache(triton_cache: Path) -> None:
    plugin = Plugin(Scale())
    warmreg.warm(CONFIG, target="cuda:90", plugins=[plugin], entry_points=False, workers=1)
    again = warmreg.warm(CONFIG, target="cuda:90", plugins=[plugin], entry_points=False, workers=1)
    assert again.compiled == 0 and again.from_cache == 3


def test_rocm_target_gets_amd_code(triton_cache: Path) -> None:
    report = warmreg.warm(CONFIG, target="rocm:gfx942", plugins=[Plugin(Scale(sizes=(16,)))], entry_points=False)
    assert report.ok
    assert list(triton_cache.rglob("*.hsaco")) and not _cubins(triton_cache)


def test_two_targets_in_one_process_do_not_share_a_backend(triton_cache: Path) -> None:
    plugin = Plugin(Scale(sizes=(16,)))
    warmreg.warm(CONFIG, target="cuda:90", plugins=[plugin], entry_points=False)
    warmreg.warm(CONFIG, target="cuda:100", plugins=[plugin], entry_points=False)
    archs = sorted(json.loads(p.read_text())["target"]["arch"] for p in triton_cache.rglob("_scale_kernel.json"))
    assert archs == [90, 100]


@pytest.mark.parametrize("workers", [1, 2])
def test_one_failing_key_does_not_stop_the_others(workers: int) -> None:
    plugins = [Plugin(Scale(), Broken())]
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=plugins, entry_points=False, workers=workers, on_error="continue")
    assert report.compiled == 3 and len(report.failed) == 1
    assert report.failed[0].kernel == "tests.broken" and "undefined_name" in (report.failed[0].error or "")
    with pytest.raises(warmreg.CompileFailed) as info:
        warmreg.warm(CONFIG, target="cuda:90", plugins=plugins, entry_points=False, workers=workers)
    assert info.value.report.from_cache == 3  # type: ignore[attr-defined]


def test_stop_on_first_failure() -> None:
    with pytest.raises(warmreg.CompileFailed) as info:
        warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Broken(), Scale())], entry_points=False, workers=1, on_error="stop")
    statuses = {r.kernel: r.status for r in info.value.report.results}  # type: ignore[attr-defined]
    assert statuses["tests.broken"] == "failed"


def test_report_is_json_serializable_and_readable_back() -> None:
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False)
    back = warmreg.WarmReport.from_json(json.loads(report.dumps()))
    assert back.results == report.results
    assert "3 keys over 1 kernels for cuda:90" in report.summary()
    per = report.per_kernel()["tests.scale"]
    assert per["keys"] == 3 and per["seconds"] > 0


def test_each_warmed_key_records_its_triton_specialization() -> None:
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False)
    by_class = {r.key.n_class: r.triton_key for r in report.results}  # type: ignore[attr-defined]
    assert "('constexpr', 1)" in by_class["one"]  # Triton folds n == 1 into a constexpr
    assert "('i32', 'D')" in by_class["div16"] and "('i32', '')" in by_class["other"]


def test_warmup_inputs_that_do_not_reproduce_the_key_fail_that_key() -> None:
    class Liar(Scale):
        def warmup_inputs(self, key):  # type: ignore[no-untyped-def]
            inputs = dict(super().warmup_inputs(key))
            inputs["x"] = warmreg.meta((17,), torch.float16)  # always the "other" class
            return inputs

    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Liar())], entry_points=False, on_error="continue")
    failed = {r.key.n_class: r.error for r in report.failed}  # type: ignore[attr-defined]
    assert set(failed) == {"one", "div16"} and "n_class" in failed["one"]


def test_bad_arguments() -> None:
    with pytest.raises(warmreg.WarmregError, match="workers"):
        warmreg.warm(CONFIG, target="cuda:90", entry_points=False, workers=0)
    with pytest.raises(warmreg.WarmregError, match="on_error"):
        warmreg.warm(CONFIG, target="cuda:90", entry_points=False, on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(warmreg.TargetError):
        warmreg.warm(CONFIG, target="cuda:sm90", entry_points=False)


def _parse_failing(monkeypatch: pytest.MonkeyPatch, message: str, times: int) -> list[str]:
    """Make Triton's parse of a kernel's source raise ``SystemError(message)`` on its first ``times`` calls
    (after the prefetch's import of the installed plugins, which parses their kernels on its own thread)."""
    from triton.runtime.jit import JITFunction

    from warmreg.api.prefetch import wait_for_plugins

    wait_for_plugins()

    calls: list[str] = []
    parse = JITFunction.parse

    def failing(self: JITFunction) -> object:
        calls.append(self.__name__)
        if len(calls) <= times:
            raise SystemError(message)
        return parse(self)

    monkeypatch.setattr(JITFunction, "parse", failing)
    return calls


@pytest.mark.parametrize("workers", [1, 2])
def test_cpython_ast_parse_thread_race_is_compiled_again(monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    # CPython 3.11.7 (this machine, CI) fails ast.parse spuriously when two threads parse at once.
    calls = _parse_failing(monkeypatch, "AST constructor recursion depth mismatch (before=39, after=31)", times=2)
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale(sizes=(16,)))], entry_points=False, workers=workers)
    assert [r.status for r in report.results] == ["compiled"]
    assert calls == ["_scale_kernel"] * 3  # two spurious failures, then the compile that wrote the binary


def test_other_system_errors_and_a_persistent_race_still_fail_the_key() -> None:
    # each patch in its own context: undoing the test's monkeypatch would also undo the isolated TRITON_CACHE_DIR
    with pytest.MonkeyPatch.context() as mp:
        calls = _parse_failing(mp, "some other interpreter error", times=1)
        report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale(sizes=(16,)))], entry_points=False, workers=2, on_error="continue")
    assert [r.status for r in report.results] == ["failed"] and "some other interpreter error" in report.results[0].error
    assert len(calls) == 1
    with pytest.MonkeyPatch.context() as mp:
        calls = _parse_failing(mp, "AST constructor recursion depth mismatch (before=3, after=1)", times=100)
        report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(Scale(sizes=(17,)))], entry_points=False, workers=2, on_error="continue")
    assert [r.status for r in report.results] == ["failed"] and "recursion depth mismatch" in report.results[0].error
    assert len(calls) == 4  # bounded: a race that keeps failing is reported, not retried forever


def test_warm_with_progress_on_a_pool_finishes(tmp_path: Path) -> None:
    """From Triton 3.7 an unresolved FutureKernel forwards attribute reads to result(): reporting a
    key's progress from its own pool thread must not wait for itself (it hung the CLI's warm)."""
    import subprocess
    import sys

    code = (
        "import warmreg; from tests.helpers import CONFIG, Plugin, Scale; "
        "r = warmreg.warm(CONFIG, target='cuda:90', plugins=[Plugin(Scale())], entry_points=False, workers=2, progress=True); "
        "print('ok', r.compiled + r.from_cache, len(r.failed))"
    )
    env = {**__import__("os").environ, "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env,
                          cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert done.returncode == 0 and done.stdout.split()[:3] == ["ok", "3", "0"], done.stderr[-2000:]


def _signature_kernel() -> tuple[Any, list[Any]]:
    seen: list[Any] = []

    class Echo(warmreg.TritonKernel[Any]):
        name = "tests.echo"

        @warmreg.kernel_launcher
        def __call__(self, a: Any, /, b: Any, c: Any = 3, *, d: Any, e: Any = 5) -> Any:
            seen.append((a, b, c, d, e))
            return warmreg.LaunchSpec(None, None, {}, (a, b, c, d, e))  # type: ignore[arg-type]

        @warmreg.kernel_launcher
        def spread(self, *args: Any, **kwargs: Any) -> Any:
            return warmreg.LaunchSpec(None, None, {}, (args, kwargs))  # type: ignore[arg-type]

        @warmreg.kernel_launcher
        def bad(self, x: Any) -> Any:
            return x

    return Echo(), seen


def test_the_launch_keeps_the_launch_codes_signature_and_passes_each_argument_on() -> None:
    import inspect

    echo, seen = _signature_kernel()
    assert str(inspect.signature(type(echo).__call__)) == str(inspect.signature(type(echo).__call__.__wrapped__))
    assert echo(1, 2, d=4) == (1, 2, 3, 4, 5) and echo(1, b=2, c=7, d=4, e=6) == (1, 2, 7, 4, 6)
    assert echo.spread(1, k=2) == ((1,), {"k": 2})  # *args/**kwargs launch code: forwarded as they came
    for wrong in (lambda: echo(1, 2), lambda: echo(a=1, b=2, d=4), lambda: echo(1, 2, 3, 4)):
        with pytest.raises(TypeError):  # exactly what calling the launch code itself raises
            wrong()
    assert len(seen) == 2
    with pytest.raises(warmreg.KernelContractError, match="launch code returned int"):
        echo.bad(3)


@pytest.mark.parametrize("inline", [True, False])
def test_a_warm_of_cache_hits_compiles_inline_and_one_with_a_miss_on_the_pool(
    triton_cache: Path, monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    from warmreg.pipeline import compile as compile_mod

    pooled: list[int] = []
    real = compile_mod._run_async
    monkeypatch.setattr(compile_mod, "_run_async", lambda tasks, *a: (pooled.append(len(tasks)), real(tasks, *a))[1])
    monkeypatch.setattr(compile_mod, "INLINE_HITS", inline)
    first = warmreg.warm(CONFIG, plugins=[Plugin(Scale())], entry_points=False, target="cuda:90", workers=4)
    assert pooled == [first.declared] and first.compiled == first.declared  # cold: every key on the pool
    warmreg.reset_state()  # nothing in memory: the next warm reads the disk cache
    again = warmreg.warm(CONFIG, plugins=[Plugin(Scale())], entry_points=False, target="cuda:90", workers=4)
    assert {r.status for r in again.results} == {"disk_cache"}
    assert pooled == ([first.declared] if inline else [first.declared, again.declared])
