"""``WarmConfig.load`` of a real vLLM 0.33 ``VllmConfig`` plans the keys of the example-format JSON, and the plugins'
readings of vLLM's rules (the DeepSeek-V4 cache layouts, Kimi-K3's hybrid block size) are vLLM's own.

Runs in the vLLM venv (``bash scripts/engine-envs.sh test vllm``); skips, naming why, elsewhere.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from warmreg_deepseek_v4.backends import FLASHINFER_KV_CACHE_DTYPES, flashinfer_rope_quant, kv_cache_layout
from warmreg_deepseek_v4.dspark import num_speculative_tokens
from warmreg_deepseek_v4.model import DSV4, KV_CACHE_DTYPES, fp8_checkpoint
from warmreg_kimi_k3.backends import kv_block_size
from warmreg_kimi_k3.model import KimiK3

import warmreg
from warmreg import ConfigError, WarmConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cases
from plans import differences, engine_or_skip, planned_keys

# vLLM detects no platform on a machine without a GPU unless told ("Device string must not be empty").
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
engine_or_skip("vLLM", "vllm", "vllm.engine.arg_utils")

CASES = list(cases.VLLM_CASES)
FLASHINFER = "FLASHINFER_MLA_SPARSE_DSV4"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("models")
    return {case: cases.build_vllm(case, root) for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_plan_keys_equal_the_example_format_json(built: dict[str, Any], case: str) -> None:
    # vLLM's CPU platform rewrites max_num_batched_tokens (cases.VLLM_CPU_REWRITTEN), and takes the CPU's batch
    # defaults (cases.VLLM_GPU_DEFAULTED): the GPU values come from the deployment's JSON, the rest from the object.
    target = cases.target_of(case)
    got = planned_keys(built[case], target=target, serving=cases.gpu_serving(case))
    want = planned_keys(cases.expected_vllm(case), target=target)
    assert got == want, differences(got, want)


def test_the_real_object_reads_as_the_example(built: dict[str, Any]) -> None:
    vc = built["flash"]
    cfg = WarmConfig.load(vc)
    example = WarmConfig.load(cases.EXAMPLES / "deepseek_v4_flash.json")
    # vLLM rewrote quant_method to deepseek_v4_fp8: still an FP8 checkpoint, the same model
    assert cfg.model["quantization_config"]["quant_method"] == "deepseek_v4_fp8"
    assert fp8_checkpoint(cfg) and fp8_checkpoint(example) and fp8_checkpoint(vc.model_config.hf_config)
    assert DSV4.from_config(cfg) == DSV4.from_config(example)
    assert type(vc.attention_config.backend).__name__ == "AttentionBackendEnum"
    want = {k: v for k, v in example.serving.items() if k not in cases.VLLM_CPU_REWRITTEN}
    assert {k: cfg.serving[k] for k in want} == want
    assert "AttentionBackendEnum.FLASHMLA_SPARSE_DSV4" in cfg.origins["attention_backend"]


def test_the_examples_model_sections_are_vllm_inputs(built: dict[str, Any]) -> None:
    # built from examples/{deepseek_v4_flash,deepseek_v4_pro,deepseek_v4_flash_0731_dspark,kimi_k3}.json as they are
    types = {case: vc.model_config.hf_config.model_type for case, vc in built.items()}
    assert types["flash"] == types["pro"] == types["flash_dspark"] == "deepseek_v4" and types["kimi_k3"] == "kimi_k3"
    assert built["kimi_k3"].model_config.is_hybrid and built["kimi_k3"].model_config.use_mla


def test_a_cpu_built_config_holds_the_cpus_batch_defaults_until_the_gpus_are_passed(built: dict[str, Any]) -> None:
    """``vllm serve`` at TP 1: vLLM takes max_num_seqs / max_num_batched_tokens from the GPU; built on the CPU the
    config holds 128 * TP and (MLA) max_model_len. The plan is the H200's only with the H200's values passed."""
    vc = built["flash_serve"]
    assert (vc.scheduler_config.max_num_seqs, vc.scheduler_config.max_num_batched_tokens) == (128, 1048576)
    want = planned_keys(cases.expected_vllm("flash_serve"))
    assert planned_keys(vc, serving={"max_num_seqs": 1024, "max_num_batched_tokens": 8192}) == want
    assert planned_keys(vc) != want and planned_keys(vc, serving={"max_num_batched_tokens": 8192}) != want


def test_flash_dspark_is_vllms_dspark_with_its_default_draft_count(built: dict[str, Any]) -> None:
    vc = built["flash_dspark"]
    spec = vc.speculative_config
    assert spec.method == "dspark" and spec.use_dspark() and spec.num_speculative_tokens == 5  # dspark_block_size
    cfg = WarmConfig.load(vc, serving=cases.gpu_serving("flash_dspark"))
    example = WarmConfig.load(cases.expected_vllm("flash_dspark"))
    assert "num_speculative_tokens" not in example.serving and num_speculative_tokens(example) == 5
    assert cfg.serving["num_speculative_tokens"] == 5 and cfg.serving["speculative_method"] == "dspark"


def test_pro_on_flashinfer_keeps_vllms_fp8_name(built: dict[str, Any]) -> None:
    cfg = WarmConfig.load(built["pro_flashinfer"])
    assert (cfg.serving["attention_backend"], cfg.serving["kv_cache_dtype"]) == (FLASHINFER, "fp8")
    assert kv_cache_layout(cfg, warmreg.Platform.parse("cuda:100")) == "fp8"
    with pytest.raises(ConfigError) as info:
        warmreg.plan(built["pro_flashinfer"], target="cuda:90", serving=cases.gpu_serving("pro_flashinfer"))
    assert info.value.field == "serving.attention_backend" and "cuda:90" in str(info.value)


# -- the DeepSeek-V4 cache layouts are vLLM's (models/deepseek_v4) -------------------------------------------------
CAPABILITIES = [(9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]


def _dsv4(**serving: Any) -> WarmConfig:
    return WarmConfig.load(cases.EXAMPLES / "deepseek_v4_pro.json", serving=serving)


def _vllm_layout(use_fp8_ds_mla_layout: bool, name: str) -> str | None:
    """The layout vLLM's ``_resolve_dsv4_kv_cache_dtype`` gives ``name``, or None where it raises."""
    import torch
    from vllm.models.deepseek_v4.attention import _resolve_dsv4_kv_cache_dtype

    try:
        _, dtype = _resolve_dsv4_kv_cache_dtype(use_fp8_ds_mla_layout, name, None)
    except ValueError:
        return None
    return {torch.uint8: "fp8_ds_mla", torch.float8_e4m3fn: "fp8", torch.bfloat16: "bfloat16"}[dtype]


@pytest.mark.parametrize("capability", CAPABILITIES)
@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_flashinfer_takes_exactly_the_cache_dtypes_its_backend_declares(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str
) -> None:
    """FLASHINFER_MLA_SPARSE_DSV4: warmreg plans a pair iff vLLM's backend declares it (supported dtypes, compute
    capability, supports_combination), and the layout is the one the attention class of that family stores."""
    import torch
    import vllm.utils.flashinfer
    from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import DeepseekV4FlashInferMLASparseBackend as Backend
    from vllm.platforms.interface import DeviceCapability

    monkeypatch.setattr(vllm.utils.flashinfer, "has_flashinfer_sparse_mla_sm120", lambda: True)  # installed there
    cap = DeviceCapability(*capability)
    declared = (
        Backend.supports_kv_cache_dtype(name)
        and Backend.supports_compute_capability(cap)
        and Backend.supports_combination(
            head_size=512, dtype=torch.bfloat16, kv_cache_dtype=name, block_size=256, use_mla=True, has_sink=True,
            use_sparse=True, use_mm_prefix=False, device_capability=cap,
        ) is None
    )  # fmt: skip
    target = warmreg.Platform.parse(f"cuda:{capability[0] * 10 + capability[1]}")
    config = _dsv4(attention_backend=FLASHINFER, kv_cache_dtype=name)
    if not declared:
        with pytest.raises(ConfigError) as info:
            kv_cache_layout(config, target)
        assert info.value.field in ("serving.kv_cache_dtype", "serving.attention_backend")
        assert target.target in str(info.value) and "fix:" in str(info.value)
        return
    # SM10x builds DeepseekV4FlashInferMLAAttention (plain rows), SM12x DeepseekV4FlashInferSM120Attention (fp8_ds_mla)
    assert kv_cache_layout(config, target) == _vllm_layout(capability[0] == 12, name)
    assert FLASHINFER_KV_CACHE_DTYPES[capability[0]][name] == kv_cache_layout(config, target)


@pytest.mark.parametrize("name", KV_CACHE_DTYPES)
def test_every_other_backend_stores_vllms_fp8_ds_mla_layout(name: str) -> None:
    """FlashMLA (and ROCm's, XPU's attention) keep ``use_fp8_ds_mla_layout``: vLLM's resolution of each name."""
    want = _vllm_layout(True, name)
    for target in ("cuda:90", "cuda:100", "rocm:gfx942"):
        config = _dsv4(attention_backend="FLASHMLA_SPARSE_DSV4", kv_cache_dtype=name)
        if want is None:
            with pytest.raises(ConfigError, match=r"serving\.kv_cache_dtype"):
                kv_cache_layout(config, warmreg.Platform.parse(target))
        else:
            assert kv_cache_layout(config, warmreg.Platform.parse(target)) == want


@pytest.mark.parametrize(
    ("tp", "name", "fp8_wo_a"), [(1, "fp8", True), (1, "auto", True), (8, "fp8", True), (1, "fp8", False)]
)
def test_flashinfer_rope_quant_is_vllms(tp: int, name: str, fp8_wo_a: bool) -> None:
    """vLLM's ``rope_quant_unsupported_reason`` on an SM10x FlashInfer layer of the Pro example decides whether the
    Triton inverse RoPE + FP8 quant runs; warmreg plans it exactly when vLLM's reason is not None."""
    import torch
    from vllm.models.deepseek_v4.nvidia.ops.o_proj import rope_quant_unsupported_reason

    config = _dsv4(attention_backend=FLASHINFER, kv_cache_dtype=name, tensor_parallel_size=tp)
    if not fp8_wo_a:
        config = WarmConfig.load(
            {"model": {**config.model, "quantization_config": None}, "serving": dict(config.serving)}
        )
    model, target = DSV4.from_config(config), warmreg.Platform.parse("cuda:100")
    layer = SimpleNamespace(
        n_local_heads=model.num_attention_heads // tp,
        kv_cache_torch_dtype=torch.float8_e4m3fn if kv_cache_layout(config, target) == "fp8" else torch.bfloat16,
        wo_a=SimpleNamespace(weight=torch.empty(0, dtype=torch.float8_e4m3fn if fp8_wo_a else torch.bfloat16)),
    )
    import inspect

    # vLLM 0.34 also takes the VllmConfig (it refuses RopeQuant under LoRA, which no deployment here has)
    extra = [SimpleNamespace(lora_config=None)] if len(inspect.signature(rope_quant_unsupported_reason).parameters) > 1 else []
    fused = rope_quant_unsupported_reason(layer, *extra) is None
    assert flashinfer_rope_quant(model, config, target) == fused
    planned = {k.name for k in warmreg.plan(config, target=target).kernels}
    assert ("deepseek_v4.inv_rope_fp8_quant" in planned) == (not fused)


# -- Kimi-K3's block size is vLLM's hybrid alignment (vllm/platforms/interface.py) ---------------------------------
@pytest.mark.parametrize("requested", [None, 16, 64, 200, 768, 1024])
@pytest.mark.parametrize(("backend", "cache", "tp", "drafts"), [
    ("FLASHMLA", "auto", 8, 3), ("FLASHMLA", "fp8", 8, 3), ("TRITON_MLA", "auto", 4, 0), ("TRITON_MLA", "fp8_e4m3", 8, 1),
])  # fmt: skip
def test_kimi_block_size_is_vllms_hybrid_alignment(
    built: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    requested: int | None,
    backend: str,
    cache: str,
    tp: int,
    drafts: int,
) -> None:
    """``kv_block_size`` against vLLM's own ``update_block_size_for_backend`` steps on the real Kimi-K3 config: the
    backend's preferred size when none is requested, then ``Platform._align_hybrid_block_size`` (the engine's MLA
    layers' one backend stands in for the loaded model's, whose layers a CPU-built config does not hold)."""
    from vllm.config.cache import CacheConfig
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

    backend_cls = {"FLASHMLA": FlashMLABackend, "TRITON_MLA": TritonMLABackend}[backend]
    vc = built["kimi_k3"]
    monkeypatch.setattr(vc.cache_config, "cache_dtype", cache)
    monkeypatch.setattr(vc.cache_config, "mamba_page_size_padded", None)
    monkeypatch.setattr(vc.parallel_config, "tensor_parallel_size", tp)
    if drafts:
        monkeypatch.setattr(vc.speculative_config, "num_speculative_tokens", drafts)
    else:
        monkeypatch.setattr(vc, "speculative_config", None)
    monkeypatch.setattr(Platform, "_find_non_ssm_backends", classmethod(lambda cls, config: [backend_cls]))
    monkeypatch.setattr(
        vc.cache_config, "block_size",
        backend_cls.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE) if requested is None else requested,
    )  # fmt: skip
    serving = {"attention_backend": backend, "block_size": requested}
    cfg = WarmConfig.load(vc, serving={k: v for k, v in serving.items() if v is not None})
    assert cfg.serving.get("num_speculative_tokens", 0) == drafts
    if requested is None:
        cfg = WarmConfig.load(
            {"model": dict(cfg.model), "serving": {k: v for k, v in cfg.serving.items() if k != "block_size"}}
        )
    Platform._align_hybrid_block_size(vc, backend_cls)
    assert kv_block_size(KimiK3.from_config(cfg), cfg) == vc.cache_config.block_size
    # a started engine's block size maps to itself
    started = WarmConfig.load(vc, serving={"attention_backend": backend})
    assert kv_block_size(KimiK3.from_config(started), started) == vc.cache_config.block_size


def test_kimi_example_block_size_is_what_vllm_runs(built: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The example's 768, from the real config's requested 64 (the CPU platform's 16 gives the same)."""
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend

    vc = built["kimi_k3"]
    assert vc.cache_config.block_size == 16  # vLLM's CPU MLA backend forced it (cases.VLLM_CPU_ALIGNED)
    monkeypatch.setattr(vc.cache_config, "block_size", 64)
    monkeypatch.setattr(vc.cache_config, "mamba_page_size_padded", None)
    monkeypatch.setattr(Platform, "_find_non_ssm_backends", classmethod(lambda cls, config: [FlashMLABackend]))
    Platform._align_hybrid_block_size(vc, FlashMLABackend)
    assert vc.cache_config.block_size == cases.example("kimi_k3")["serving"]["block_size"] == 768
    assert vc.cache_config.mamba_page_size_padded == 768 * 1152
