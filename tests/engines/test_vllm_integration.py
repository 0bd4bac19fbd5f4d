"""warmreg-vllm started by vLLM itself: its ``vllm.general_plugins`` entry point loaded by vLLM's own loader,
warm called once with the worker's real ``VllmConfig`` before vLLM's warmup and graph capture, the monitor after.

Runs in the vLLM venv (``bash scripts/engine-envs.sh test vllm``, which installs warmreg-vllm there); skips, naming
why, elsewhere. No GPU here: the worker's own ``compile_or_warm_up_model`` and ``load_model`` are replaced by
recorders of what vLLM's do (``kernel_warmup``, ``capture_model``, weights) before the plugin wraps them, and warm
plans the real config and compiles nothing (its report is a real, empty warm).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cases
from plans import StartupEvents, differences, engine_or_skip, planned_keys

if importlib.util.find_spec("vllm") is None:  # before touching the environment: the main suite collects this too
    pytest.skip(
        "vLLM is not installed here; run in its venv: bash scripts/engine-envs.sh test vllm", allow_module_level=True
    )
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # keeps vLLM's Triton on without a driver (0.34 needs it on CPU)
engine_or_skip("vLLM", "vllm.engine.arg_utils", "vllm.v1.worker.gpu_worker", "warmreg_vllm.plugin")

import vllm.plugins  # noqa: E402
from vllm.v1.worker import gpu_worker  # noqa: E402

import warmreg  # noqa: E402
from warmreg import monitoring  # noqa: E402


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> StartupEvents:
    """vLLM's worker with recording stand-ins for its GPU-only steps, the plugin's settings in the environment,
    and warm replaced by a spy that records the config and warms nothing (a real, empty warm)."""
    ev = StartupEvents()

    def load_model(self: Any, *args: Any, **kwargs: Any) -> None:
        ev.add("load_model")

    def compile_or_warm_up_model(self: Any) -> float:
        ev.add("kernel_warmup")  # vLLM: torch.compile dummy runs, kernel_warmup(self), then capture_model()
        ev.add("capture_model")
        return 0.0

    monkeypatch.setattr(gpu_worker.Worker, "load_model", load_model)
    monkeypatch.setattr(gpu_worker.Worker, "compile_or_warm_up_model", compile_or_warm_up_model)
    ev.spy_on_warm(monkeypatch)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setenv("WARMREG_WARM", "1")
    monkeypatch.setenv("WARMREG_MONITOR", "record")
    monkeypatch.setenv("WARMREG_RECORD", str(tmp_path / "misses.jsonl"))
    yield ev
    ev.disarm_all()


def test_the_entry_point_is_in_vllms_group() -> None:
    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "warmreg"]
    assert ep.value == "warmreg_vllm.plugin:register"


def test_vllm_loads_the_plugin_which_warms_once_before_capture(events: StartupEvents, tmp_path: Path) -> None:
    vc = cases.build_vllm("flash", tmp_path)  # EngineArgs.create_engine_config loads the general plugins itself
    vllm.plugins.load_general_plugins()  # as WorkerWrapperBase.init_worker does in a worker (once per process)
    worker = gpu_worker.Worker.__new__(gpu_worker.Worker)  # the GPU-free part of a worker: its config
    worker.vllm_config = vc

    worker.load_model()
    assert warmreg.api.prefetch._plugins_thread is not None  # the prefetch started with the weights' load
    worker.compile_or_warm_up_model()
    worker.compile_or_warm_up_model()  # a second call (vLLM's sleep/wake) warms nothing again

    assert events.log == [
        ("load_model", False),
        ("warmreg.warm", False),
        ("kernel_warmup", False),  # vLLM's own warmup compiles its kernels: not a miss
        ("capture_model", False),
        ("kernel_warmup", True),  # armed after the first capture, once
        ("capture_model", True),
    ]
    (config,) = events.configs
    assert config is vc  # the worker's own, final config
    serving = {k: cases.expected_vllm("flash")["serving"][k] for k in cases.VLLM_CPU_REWRITTEN}
    got, want = planned_keys(config, serving=serving), planned_keys(cases.expected_vllm("flash"))
    assert got == want, differences(got, want)
    armed = monitoring.current()
    assert armed is not None and armed.mode == "record"


def test_off_unless_asked(events: StartupEvents, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WARMREG_WARM")
    vllm.plugins.load_general_plugins()
    worker = gpu_worker.Worker.__new__(gpu_worker.Worker)
    worker.vllm_config = None
    worker.compile_or_warm_up_model()
    assert events.log == [("kernel_warmup", False), ("capture_model", False)]


def test_a_bad_setting_stops_vllm_naming_it(events: StartupEvents, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARMREG_MONITOR", "loud")
    with pytest.raises(warmreg.ConfigError, match=r"WARMREG_MONITOR.*off, warn, error, record"):
        vllm.plugins.load_general_plugins()


def test_worker_cls_warms_once_even_with_the_plugin_on(events: StartupEvents, tmp_path: Path) -> None:
    """``--worker-cls warmreg_vllm.worker.WarmregWorker`` beside the enabled general plugin: one warm a process."""
    from warmreg_vllm.worker import WarmregWorker

    vllm.plugins.load_general_plugins()
    worker = WarmregWorker.__new__(WarmregWorker)
    worker.vllm_config = cases.build_vllm("flash", tmp_path)
    worker.compile_or_warm_up_model()
    assert [what for what, _ in events.log] == ["warmreg.warm", "kernel_warmup", "capture_model"]
    assert monitoring.current() is not None


def test_vllms_jit_monitor_and_warmreg_s_both_see_a_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``--jit-monitor-mode`` (``vllm.utils.jit_monitor.activate``: Triton's post-compile hook, chained) and
    warmreg's monitor (Triton's pre-compile hook, chained) armed together: one compile reaches both."""
    import triton
    import triton.language as tl
    from vllm.utils import jit_monitor

    from warmreg import Platform, _triton

    @triton.jit
    def _copy(x_ptr, y_ptr, BLOCK: tl.constexpr):
        tl.store(y_ptr + tl.arange(0, BLOCK), tl.load(x_ptr + tl.arange(0, BLOCK)))

    seen: list[str] = []
    monkeypatch.setattr(jit_monitor, "HAS_TRITON", True)  # False in a process that imported vLLM without a driver
    monkeypatch.setattr(jit_monitor, "_active", False)
    monkeypatch.setattr(jit_monitor, "_log_triton_jit_compile", lambda name, kwargs: seen.append(name))
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", triton.knobs.runtime.jit_post_compile_hook)
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", triton.knobs.runtime.jit_cache_hook)
    jit_monitor.activate(mode="warn")  # vLLM arms its own at the end of compile_or_warm_up_model
    with warmreg.monitor("record") as mon, _triton.cross_target(Platform.parse("cuda:90")):
        x = warmreg.meta((64,), __import__("torch").float32)
        _copy.warmup(x, x, BLOCK=64, grid=(1,))
    (miss,) = mon.misses
    assert miss.kernel is None  # not a warmreg kernel: reported as unregistered
    assert [name.rpartition(".")[2] for name in seen] == ["_copy"]
