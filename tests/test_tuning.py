"""Autotuned kernels: candidates planned and compiled per key, launched by choice, chosen and kept."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import warmreg
from tests.helpers import CONFIG, Plugin, TunedDouble, TunedKey
from warmreg import _triton
from warmreg.pipeline.bind import Task
from warmreg.runtime import launch
from warmreg.stages import tuning


def _plan(kernel: warmreg.TritonKernel[Any] | None = None, target: str = "cuda:90") -> warmreg.Plan:
    return warmreg.plan(CONFIG, target=target, plugins=[Plugin(kernel or TunedDouble())], entry_points=False)


def test_every_candidate_of_every_tuning_key_is_a_planned_key() -> None:
    plan = _plan(TunedDouble(dtypes=(torch.float32, torch.float16)))
    keys = plan.kernel("tests.tuned_double").keys
    assert sorted(keys) == sorted(TunedKey(dtype=d, config=i) for d in ("float16", "float32") for i in (0, 1))


def test_a_cross_warm_compiles_each_candidate_with_its_constexprs_and_options() -> None:
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(TunedDouble())], entry_points=False, workers=1)
    assert report.ok and report.compiled == 2 and tuple(report.stage("tuning").get("choices", ())) == ()  # no GPU here: nothing benchmarked
    specs = {r.key.config: json.loads(r.specialization_data or "{}") for r in report.results}  # type: ignore[attr-defined]
    assert set(specs) == {0, 1}
    assert specs[0]["constant_vals"] == [16] and specs[1]["constant_vals"] == [64]  # BLOCK, Triton's specialization
    assert specs[0]["options"]["num_warps"] == 1 and specs[1]["options"]["num_warps"] == 2


def test_a_cpu_launch_takes_candidate_zero_or_the_forced_or_the_tuned_one() -> None:
    kernel = TunedDouble()
    x = torch.arange(100, dtype=torch.float32)
    out, block = kernel(x)
    assert torch.equal(out, 2 * x) and block.item() == 16  # never tuned: candidate 0
    with warmreg.use_config(1):
        out, block = kernel(x)
    assert torch.equal(out, 2 * x) and block.item() == 64
    launch.TUNED[kernel.name] = {TunedKey(dtype="float32"): 1}
    assert kernel(x)[1].item() == 64


def test_an_untuned_gpu_launch_is_an_autotune_miss_of_the_monitor() -> None:
    kernel = TunedDouble()
    spec = warmreg.LaunchSpec(TunedKey(dtype="float32"), lambda meta: (1,), {"n": 4}, None)  # no CPU tensor: a GPU launch
    with warmreg.monitor("record") as mon:
        chosen = launch._tuned(kernel, spec)
    assert chosen.key == TunedKey(dtype="float32", config=0) and chosen.kwargs["BLOCK"] == 16
    (miss,) = mon.misses
    assert miss.kind == "autotune" and miss.kernel == kernel.name and "no warm on this GPU tuned it" in miss.explain()
    launch.TUNED[kernel.name] = {TunedKey(dtype="float32"): 1}
    with warmreg.monitor("error"):
        assert launch._tuned(kernel, spec).kwargs["BLOCK"] == 64  # tuned: no miss
    del launch.TUNED[kernel.name]
    with warmreg.monitor("error"), pytest.raises(warmreg.JitMissError, match="autotuner benchmark"):
        launch._tuned(kernel, spec)


class _Bench:
    """Stands in for Triton's do_bench: candidate i takes ``times[i]`` ms; counts the benchmarks."""

    def __init__(self, times: dict[int, float]) -> None:
        self.times, self.calls = times, 0
        self.runs: list[tuple[int, float, float]] = []  # (candidate, warmup_ms, rep_ms)

    def __call__(self, fn: Any, *, warmup_ms: float, rep_ms: float) -> float:
        fn()  # launches on CPU tensors (the interpreter), under the forced candidate
        self.calls += 1
        index = launch.FORCE_CONFIG.get() or 0
        self.runs.append((index, warmup_ms, rep_ms))
        return self.times[index]


@pytest.fixture
def gpu_standin(monkeypatch: pytest.MonkeyPatch) -> _Bench:
    bench = _Bench({0: 0.030, 1: 0.010})
    monkeypatch.setattr(_triton, "benchmark", bench)
    monkeypatch.setattr(_triton, "device_name", lambda: "Test GPU 9000")
    monkeypatch.setattr(_triton, "torch_device", lambda: torch.device("cpu"))
    return bench


def _tasks(plan: warmreg.Plan, failed: set[int] = frozenset()) -> list[Task]:  # type: ignore[assignment]
    tasks = [Task(kp, key) for kp, key in plan.items()]
    for t in tasks:
        t.status = "failed" if t.key.config in failed else "compiled"  # type: ignore[attr-defined]
    return tasks


def test_tune_benchmarks_keeps_the_fastest_and_a_second_warm_reads_it(gpu_standin: _Bench) -> None:
    plan = _plan()
    stage = tuning.Tune()
    stage.after_load(plan, _tasks(plan))
    base = TunedKey(dtype="float32")
    assert launch.TUNED["tests.tuned_double"] == {base: 1} and gpu_standin.calls == 2
    (choice,) = stage.choices
    assert choice.source == "benchmark" and choice.microseconds == {0: 30.0, 1: 10.0}
    path = tuning.choices_path("Test GPU 9000")
    assert path.parent.parent == Path(warmreg._triton.cache.cache_dir()) and path.name.startswith("Test_GPU_9000-triton-")
    launch.TUNED.clear()
    again = tuning.Tune()
    again.after_load(plan, _tasks(plan))
    assert gpu_standin.calls == 2 and again.choices[0].source == "kept" and launch.TUNED["tests.tuned_double"] == {base: 1}


@pytest.mark.parametrize(
    ("times", "finalists", "chosen"),
    [({0: 0.030, 1: 0.010}, (1,), 1), ({0: 0.0100, 1: 0.0102}, (0, 1), 0), ({0: 0.0102, 1: 0.0100}, (0, 1), 1)],
)
def test_a_clearly_slower_candidate_is_only_screened(
    gpu_standin: _Bench, times: dict[int, float], finalists: tuple[int, ...], chosen: int
) -> None:
    """Every candidate gets a short screen (the first with the full warmup, the GPU's clocks up after it); only those
    within CLOSE of the screen's fastest are measured in full, and the choice is the fastest of those."""
    gpu_standin.times = times
    plan = _plan()
    stage = tuning.Tune(warmup_ms=5.0, rep_ms=20.0, screen_ms=4.0)
    stage.after_load(plan, _tasks(plan))
    (choice,) = stage.choices
    screens = [(0, 5.0, 4.0), (1, tuning.SETTLE_MS, 4.0)]
    assert gpu_standin.runs == screens + [(i, tuning.SETTLE_MS, 20.0) for i in finalists if len(finalists) > 1]
    assert choice.finalists == finalists and choice.config == chosen and choice.to_json()["finalists"] == list(finalists)
    assert launch.TUNED["tests.tuned_double"] == {TunedKey(dtype="float32"): chosen}


def test_a_failed_candidate_is_never_chosen(gpu_standin: _Bench) -> None:
    plan = _plan()
    stage = tuning.Tune()
    stage.after_load(plan, _tasks(plan, failed={1}))
    assert stage.choices[0].config == 0 and stage.choices[0].source == "only" and gpu_standin.calls == 0


@pytest.mark.parametrize(
    "corrupt",
    ["{not json", json.dumps({"format": 99, "entries": {}}), "changed candidates", "choice out of range"],
)
def test_a_bad_or_stale_choice_file_is_ignored_and_the_key_tuned_again(gpu_standin: _Bench, corrupt: str) -> None:
    plan = _plan()
    tuning.Tune().after_load(plan, _tasks(plan))
    path = tuning.choices_path("Test GPU 9000")
    data = json.loads(path.read_text())
    (entry,) = data["entries"].values()
    if corrupt == "changed candidates":
        entry["candidates"] = ["TuneConfig(BLOCK=32, num_warps=4, num_stages=2)"] * 2
        path.write_text(json.dumps(data))
    elif corrupt == "choice out of range":
        entry["config"] = 7
        path.write_text(json.dumps(data))
    else:
        path.write_text(corrupt)
    launch.TUNED.clear()
    stage = tuning.Tune()
    stage.after_load(plan, _tasks(plan))
    assert stage.choices[0].source == "benchmark" and launch.TUNED["tests.tuned_double"] == {TunedKey(dtype="float32"): 1}
    assert json.loads(path.read_text())["format"] == 1  # rewritten whole


def test_tuning_inputs_that_give_another_key_are_a_contract_error(gpu_standin: _Bench) -> None:
    class Wrong(TunedDouble):
        def tuning_inputs(self, key: TunedKey, device: torch.device) -> dict[str, Any]:
            return {"x": torch.zeros(4, dtype=torch.float16)}

    plan = _plan(Wrong())
    with pytest.raises(warmreg.KernelContractError, match="tuning_inputs"):
        tuning.Tune().after_load(plan, _tasks(plan))


def test_default_tuning_inputs_are_the_warmup_inputs_made_real() -> None:
    inputs = TunedDouble().tuning_inputs(TunedKey(dtype="float32"), torch.device("cpu"))
    assert inputs["x"].device.type == "cpu" and inputs["x"].shape == (100,) and not inputs["x"].any()


def test_default_tuning_inputs_are_zero_bytes_of_any_dtype_with_the_meta_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every dtype is made real as zero bytes viewed as it (one torch kernel, a byte fill, whatever the dtypes:
    torch loads a kernel at its first use), over a storage of the meta tensor's size, so that its strides and
    storage offset (its alignment) are the ones the key was specialized for."""
    base = warmreg.meta((4, 9), torch.float32)
    metas = {
        "f32_view": base[1:, 1:], "bf16": warmreg.meta((3, 5), torch.bfloat16), "i64": warmreg.meta((7,), torch.int64),
        "fp8": warmreg.meta((16,), torch.float8_e4m3fn), "flag": warmreg.meta((3,), torch.bool), "empty": warmreg.meta((0,), torch.int32),
    }  # fmt: skip
    kernel = TunedDouble()
    monkeypatch.setattr(kernel, "warmup_inputs", lambda key: {**metas, "n": 3})
    made: list[torch.dtype] = []
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: made.append(kw["dtype"]) or zeros(*a, **kw))
    inputs = kernel.tuning_inputs(TunedKey(dtype="float32"), torch.device("cpu"))
    assert set(made) == {torch.uint8} and inputs["n"] == 3
    for name, meta in metas.items():
        real = inputs[name]
        assert (real.dtype, real.shape, real.stride(), real.storage_offset()) == (meta.dtype, meta.shape, meta.stride(), meta.storage_offset()), name
        assert real.untyped_storage().nbytes() == max(meta.untyped_storage().nbytes(), meta.element_size()), name
        assert not real.float().any() if real.numel() else True, name


def test_a_tuned_kernel_whose_key_has_no_config_field_is_refused() -> None:
    @attrs.frozen(kw_only=True)
    class NoConfig(warmreg.CompileKey):
        dtype: str
        num_warps: int = 4

    class Bad(TunedDouble):
        key_type = NoConfig  # type: ignore[assignment]

        def dispatch(self, *, x: torch.Tensor) -> NoConfig:  # type: ignore[override]
            return NoConfig(dtype="float32")

    with pytest.raises(warmreg.KernelContractError, match="field `config"):
        _plan(Bad())


def _gpu_choice_file(gpu_standin: _Bench) -> Path:
    """What a warm on the serving GPU keeps: the choice file of 'Test GPU 9000' (candidate 1)."""
    plan = _plan()
    tuning.Tune().after_load(plan, _tasks(plan))
    return tuning.choices_path("Test GPU 9000")


def test_a_cross_built_pack_carries_the_gpu_hosts_choices_and_its_install_keeps_them(
    gpu_standin: _Bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from warmreg.stages import build as packs_build
    from warmreg.stages import pack as packs

    choice_file = tmp_path / "gpu-choices.json"
    choice_file.write_bytes(_gpu_choice_file(gpu_standin).read_bytes())
    out = tmp_path / "pack"
    manifest = packs_build.build(
        CONFIG, out, target="cuda:90", plugins=[Plugin(TunedDouble())], entry_points=False, launcher_pythons=[],
        tuning_choices=choice_file,
    )  # fmt: skip
    assert len(manifest.entries) == 2  # both candidates compiled
    (choice,) = manifest.tuning
    assert choice.config == 1 and choice.device == "Test GPU 9000" and choice.key == TunedKey(dtype="float32").to_json()
    serving_cache = tmp_path / "serving-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(serving_cache))
    warmreg.reset_state()
    report = packs.install(out, jits={warmreg._triton.full_name(TunedDouble.jit): TunedDouble.jit})
    assert report.installed == 2 and report.choices == 1
    calls = gpu_standin.calls
    plan = _plan()
    stage = tuning.Tune()
    stage.after_load(plan, _tasks(plan))  # the serving host's warm: kept, no benchmark
    assert stage.choices[0].source == "kept" and gpu_standin.calls == calls
    assert launch.TUNED["tests.tuned_double"] == {TunedKey(dtype="float32"): 1}


def test_a_cross_build_without_choices_records_none(tmp_path: Path) -> None:
    from warmreg.stages import build as packs_build

    manifest = packs_build.build(CONFIG, tmp_path / "p", target="cuda:90", plugins=[Plugin(TunedDouble())], entry_points=False, launcher_pythons=[])
    assert manifest.tuning == () and "tuning" not in json.loads((tmp_path / "p" / "manifest.json").read_text())["body"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"config": 5}, "tuning[0].config must be an int in 0..1"),
        ({"device": 7}, "tuning[0].device must be a string"),
        ({"key": "x"}, "tuning[0].key must be a serialized compile key"),
        ({"extra": 1}, "tuning[0] has a malformed entry"),
    ],
)
def test_a_hostile_choice_in_a_manifest_is_refused_naming_the_field(
    gpu_standin: _Bench, tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    from warmreg.stages import build as packs_build
    from warmreg.stages import pack as packs
    from warmreg.stages import pack_format as _pack_format

    choice_file = tmp_path / "gpu-choices.json"
    choice_file.write_bytes(_gpu_choice_file(gpu_standin).read_bytes())
    out = tmp_path / "pack"
    packs_build.build(
        CONFIG, out, target="cuda:90", plugins=[Plugin(TunedDouble())], entry_points=False, launcher_pythons=[],
        tuning_choices=choice_file,
    )  # fmt: skip
    doc = json.loads((out / "manifest.json").read_text())
    body = doc["body"]
    body["tuning"][0].update(change)
    (out / "manifest.json").write_text(json.dumps({"body": body, "sha256": _pack_format._sha256(_pack_format._canonical(body))}))
    with pytest.raises(packs.PackError, match=re.escape(message)):
        packs.verify(out)


def test_coverage_counts_candidates_not_chosen_apart_from_unused() -> None:
    from warmreg.monitoring.coverage import coverage

    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(TunedDouble())], entry_points=False, workers=1)
    base = TunedKey(dtype="float32")
    tuned = attrs.evolve(report, stages={"tuning": {"choices": [{"kernel": "tests.tuned_double", "key": base.to_json(), "config": 1}]}})
    (row,) = coverage(tuned, {"tests.tuned_double": {attrs.evolve(base, config=1)}}, []).kernels
    assert (row.declared, row.hit, row.unused, row.not_chosen) == (2, 1, 0, 1)
    (row,) = coverage(report, {}, []).kernels  # no choice made (a cross warm): both candidates unused
    assert (row.unused, row.not_chosen) == (2, 0)


@pytest.mark.gpu
def test_gpu_warm_tunes_keeps_and_serves_the_choice_with_no_miss() -> None:
    report = warmreg.warm(CONFIG, plugins=[Plugin(TunedDouble())], entry_points=False, workers=2)
    (choice,) = tuple(report.stage("tuning").get("choices", ()))
    assert choice["source"] == "benchmark" and set(choice["microseconds"]) == {"0", "1"}  # JSON keys
    chosen = choice["config"]
    x = torch.arange(100, dtype=torch.float32, device="cuda")
    with warmreg.monitor("error") as mon:
        out, block = TunedDouble()(x)
    assert torch.equal(out, 2 * x) and block.item() == (16, 64)[chosen] and not mon.misses
    launch.TUNED.clear()
    again = warmreg.warm(CONFIG, plugins=[Plugin(TunedDouble())], entry_points=False, workers=2)
    assert again.from_cache == 2 and [c["source"] for c in again.stage("tuning")["choices"]] == ["kept"] and again.stage("tuning")["choices"][0]["config"] == chosen
