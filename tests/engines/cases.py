"""The deployments the engine tests build with the real engine classes, and their example-format JSON.

Used by the engine tests (``tests/engines/test_vllm.py``, ``test_sglang.py``, each run in its engine's
venv) and by ``scripts/record_engine_snapshots.py``, which records the same objects' attributes for
``tests/test_engine_configs.py``. The engines are imported only inside the builders.

Each case: the engine's arguments, and the example-format JSON (``{"model", "serving"}``) of the same
deployment, whose ``warmreg plan`` keys the real object's must equal.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
#: Where the plans are compared: a CUDA target, so no GPU is needed.
TARGET = "cuda:90"


def example(name: str) -> dict[str, Any]:
    return json.loads((EXAMPLES / f"{name}.json").read_text())


def model_dir(root: Path, name: str) -> str:
    """A checkpoint folder holding only the example's ``model`` section as its config.json."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(example(name)["model"], indent=2))
    return str(folder)


# -- vLLM 0.33.0 ------------------------------------------------------------------------------------
FLASH_VLLM = dict(
    max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=1048576, block_size=256,
    kv_cache_dtype="fp8_ds_mla", dtype="bfloat16", tensor_parallel_size=8,
    speculative_config={"method": "mtp", "num_speculative_tokens": 1},
)  # fmt: skip
PRO_VLLM = dict(
    max_num_batched_tokens=16384, max_num_seqs=128, max_model_len=262144, block_size=256,
    kv_cache_dtype="fp8_ds_mla", dtype="bfloat16", tensor_parallel_size=8,
    attention_backend="FLASHMLA_SPARSE_DSV4", speculative_config={"method": "mtp", "num_speculative_tokens": 1},
)  # fmt: skip
#: FlashInfer's DeepSeek-V4 backend with the cache it takes on SM10x: per-tensor FP8 rows, not fp8_ds_mla
FLASHINFER_FP8 = {"attention_backend": "FLASHINFER_MLA_SPARSE_DSV4", "kv_cache_dtype": "fp8"}

#: case -> (example, EngineArgs keywords, serving changes to the example for the same deployment)
VLLM_CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # the Flash example itself, as vLLM takes it
    "flash": ("deepseek_v4_flash", {**FLASH_VLLM, "attention_backend": "FLASHMLA_SPARSE_DSV4"}, {}),
    # no backend set: vLLM's DeepSeek-V4 default on CUDA (FlashMLA) is the example's
    "flash_no_backend": ("deepseek_v4_flash", FLASH_VLLM, {}),
    # vLLM's defaults: cache 'auto' (fp8_ds_mla under FlashMLA), no speculation, its max_num_seqs 128
    "flash_defaults": (
        "deepseek_v4_flash",
        dict(tensor_parallel_size=8, max_model_len=1048576),
        {"max_num_seqs": 128, "num_speculative_tokens": None, "speculative_method": None},
    ),
    # the Pro example itself: FlashMLA over fp8_ds_mla pages (Hopper and SM10x)
    "pro": ("deepseek_v4_pro", PRO_VLLM, {}),
    # Pro on FlashInfer's backend with an FP8 cache, planned for SM10x (TARGETS): the name stays 'fp8'
    "pro_flashinfer": ("deepseek_v4_pro", {**PRO_VLLM, **FLASHINFER_FP8}, FLASHINFER_FP8),
    # DSpark on the Flash-0731 checkpoint: num_speculative_tokens unset, so vLLM takes dspark_block_size (5), as
    # the example does; vLLM needs the draft's model path for that (build_vllm sets it: the target's own)
    "flash_dspark": (
        "deepseek_v4_flash_0731_dspark",
        {**FLASH_VLLM, "attention_backend": "FLASHMLA_SPARSE_DSV4", "speculative_config": {"method": "dspark"}},
        {},
    ),
    # `vllm serve`'s defaults at TP 1, which vLLM takes from the GPU (EngineArgs.get_batch_defaults): an H200's
    # max_num_batched_tokens 8192 and max_num_seqs 1024, where a config built on the CPU holds the CPU's 2048 * TP
    # (rewritten for MLA: VLLM_CPU_REWRITTEN) and 128 * TP; VLLM_GPU_DEFAULTED says what to pass
    "flash_serve": (
        "deepseek_v4_flash",
        dict(tensor_parallel_size=1, max_model_len=1048576),
        {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "tensor_parallel_size": 1,
         "num_speculative_tokens": None, "speculative_method": None},
    ),
    # Kimi-K3 with a requested block size of 64; vLLM raises it to 768 once the model is loaded (an MLA page of
    # 768 tokens holds a KDA state page), which the example states and the plugin computes from either. Three
    # ngram draft tokens (the example's model section has no MTP layer; the plugin reads only the count).
    # Prefix caching off: vLLM's CPU platform turns it off for MLA and then refuses the mamba block size it set
    # (it changes no key: the alignment is the same in vLLM's align mode).
    "kimi_k3": (
        "kimi_k3",
        dict(
            max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=262144, block_size=64,
            kv_cache_dtype="auto", dtype="bfloat16", tensor_parallel_size=8, attention_backend="FLASHMLA",
            enable_prefix_caching=False,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        ),
        {"speculative_method": "ngram"},
    ),
}  # fmt: skip

#: case -> the target its plans are compared for, where it is not :data:`TARGET`
VLLM_TARGETS: dict[str, str] = {"pro_flashinfer": "cuda:100"}
#: case -> environment vLLM needs to build it on a machine without a GPU (DSpark runs on Model Runner V2 only,
#: which vLLM's CPU platform does not pick without being told)
VLLM_ENV: dict[str, dict[str, str]] = {"flash_dspark": {"VLLM_USE_V2_MODEL_RUNNER": "1"}}

#: case -> the usage context the config is built for (``vllm serve`` builds it for OPENAI_API_SERVER, ``LLM`` for
#: LLM_CLASS; by default ENGINE_CONTEXT, whose batch defaults are the same on every platform)
VLLM_USAGE: dict[str, str] = {"flash_serve": "OPENAI_API_SERVER"}

#: vLLM's CPU platform disables chunked prefill for MLA models and sets max_num_batched_tokens to
#: max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS) (vllm/platforms/cpu.py): a config built on a
#: machine without a GPU does not hold the GPU value, so the tests pass the example's value here.
VLLM_CPU_REWRITTEN = ("max_num_batched_tokens",)
#: case -> settings the CPU platform rewrites that the plugin maps to the GPU's value itself: Kimi-K3's block size
#: (the CPU's MLA backend forces 16; from 16 as from 64 the plugin raises it to the 768 vLLM runs on a GPU)
VLLM_CPU_ALIGNED: dict[str, tuple[str, ...]] = {"kimi_k3": ("block_size",)}
#: case -> settings vLLM defaults from the GPU it runs on (``EngineArgs.get_batch_defaults``: device memory and name,
#: scaled by TP on the CPU platform), so a config built without that GPU holds other values: pass the GPU's
VLLM_GPU_DEFAULTED: dict[str, tuple[str, ...]] = {"flash_serve": ("max_num_seqs", "max_num_batched_tokens")}
#: case -> settings the example leaves unset, whose default vLLM and the plugin both take (vLLM writes its value)
VLLM_DEFAULTED: dict[str, tuple[str, ...]] = {"flash_dspark": ("num_speculative_tokens",)}


def gpu_serving(case: str) -> dict[str, Any]:
    """The ``serving=`` overrides that make a CPU-built config of ``case`` the GPU deployment: the JSON's values of
    the settings vLLM's CPU platform rewrote (:data:`VLLM_CPU_REWRITTEN`) or defaulted (:data:`VLLM_GPU_DEFAULTED`)."""
    serving = expected_vllm(case)["serving"]
    return {k: serving[k] for k in (*VLLM_CPU_REWRITTEN, *VLLM_GPU_DEFAULTED.get(case, ()))}


def target_of(case: str) -> str:
    """The target a vLLM case's plans are compared for."""
    return VLLM_TARGETS.get(case, TARGET)


def build_vllm(case: str, root: Path) -> Any:
    """The real ``VllmConfig`` of ``case`` (needs VLLM_TARGET_DEVICE=cpu on a machine without a GPU)."""
    from vllm.engine.arg_utils import EngineArgs

    name, kwargs, _ = VLLM_CASES[case]
    path = model_dir(root, name)
    spec = kwargs.get("speculative_config")
    if spec is not None and spec.get("method") == "dspark" and "model" not in spec:
        kwargs = {**kwargs, "speculative_config": {**spec, "model": path}}  # the draft ships in the target
    saved = {k: os.environ.get(k) for k in VLLM_ENV.get(case, {})}
    os.environ.update(VLLM_ENV.get(case, {}))
    usage = VLLM_USAGE.get(case)
    try:
        args = EngineArgs(model=path, skip_tokenizer_init=True, **kwargs)
        if usage is None:
            return args.create_engine_config()
        from vllm.usage.usage_lib import UsageContext

        return args.create_engine_config(usage_context=UsageContext[usage])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def expected_vllm(case: str) -> dict[str, Any]:
    name, _, changes = VLLM_CASES[case]
    return with_serving(example(name), changes)


# -- SGLang 0.5.23 ----------------------------------------------------------------------------------
FLASH_SGLANG = dict(
    device="cpu", chunked_prefill_size=8192, max_running_requests=256, context_length=1048576, page_size=256,
    dtype="bfloat16", tp_size=8,
)  # fmt: skip

#: case -> (example, ServerArgs keywords, serving of the same deployment in warmreg's canonical names)
SGLANG_CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # EAGLE with one MTP draft: SGLang's 2 draft tokens count the verified one
    "flash_eagle": (
        "deepseek_v4_flash",
        {**FLASH_SGLANG, "speculative_algorithm": "EAGLE", "speculative_num_steps": 1, "speculative_eagle_topk": 1,
         "speculative_num_draft_tokens": 2},
        {"num_speculative_tokens": 1, "speculative_method": "mtp"},
    ),
    # the same with the FP8 e4m3 cache and SGLang's DeepSeek-V4 backend named, not defaulted
    "flash_eagle_explicit": (
        "deepseek_v4_flash",
        {**FLASH_SGLANG, "kv_cache_dtype": "fp8_e4m3", "attention_backend": "dsv4", "speculative_algorithm": "EAGLE",
         "speculative_num_steps": 1, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 2},
        {"num_speculative_tokens": 1, "speculative_method": "mtp"},
    ),
    # DSPARK with gamma 3 (a verify window of 4 tokens) on the DSpark checkpoint (its dspark_* fields)
    "flash_dspark": (
        "deepseek_v4_flash_0731_dspark",
        {**FLASH_SGLANG, "device": "cuda", "speculative_algorithm": "DSPARK", "speculative_dspark_block_size": 3},
        {"num_speculative_tokens": 3},
    ),
    # SGLang's defaults: context_length and dtype resolve from the model config, no speculation
    "flash_defaults": (
        "deepseek_v4_flash",
        dict(device="cpu", tp_size=8),
        {"max_num_batched_tokens": 4096, "num_speculative_tokens": None, "speculative_method": None},
    ),
}


def build_sglang(case: str, root: Path) -> Any:
    """The real ``ServerArgs`` of ``case``, not yet resolved."""
    from sglang.srt.server_args import ServerArgs

    name, kwargs, _ = SGLANG_CASES[case]
    path = model_dir(root, name)
    if kwargs.get("speculative_algorithm") == "DSPARK":
        kwargs = {**kwargs, "speculative_draft_model_path": path}
    return ServerArgs(model_path=path, skip_tokenizer_init=True, **kwargs)


def expected_sglang(case: str) -> dict[str, Any]:
    """The example-format JSON of the SGLang deployment: warmreg's names for SGLang's settings.

    SGLang runs DeepSeek-V4 on its ``dsv4`` backend with the ``fp8_e4m3`` cache: FlashMLA over
    fp8_ds_mla pages (``warmreg.engines``), so the example's backend and cache stay.
    """
    name, _, changes = SGLANG_CASES[case]
    return with_serving(example(name), changes)


def with_serving(config: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``config`` with serving settings changed (``None`` removes one)."""
    out = copy.deepcopy(config)
    out.pop("description", None)
    for key, value in changes.items():
        if value is None:
            out["serving"].pop(key, None)
        else:
            out["serving"][key] = value
    return out
