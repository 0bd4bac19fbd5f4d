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
    "pro": (
        "deepseek_v4_pro",
        dict(
            max_num_batched_tokens=16384, max_num_seqs=128, max_model_len=262144, block_size=256,
            kv_cache_dtype="fp8_ds_mla", dtype="bfloat16", tensor_parallel_size=8,
            attention_backend="FLASHINFER_MLA_SPARSE_DSV4", speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        ),
        {},
    ),
}

#: vLLM's CPU platform disables chunked prefill for MLA models and sets max_num_batched_tokens to
#: max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS) (vllm/platforms/cpu.py): a config built on a
#: machine without a GPU does not hold the GPU value, so the tests pass the example's value here.
VLLM_CPU_REWRITTEN = ("max_num_batched_tokens",)


def build_vllm(case: str, root: Path) -> Any:
    """The real ``VllmConfig`` of ``case`` (needs VLLM_TARGET_DEVICE=cpu on a machine without a GPU)."""
    from vllm.engine.arg_utils import EngineArgs

    name, kwargs, _ = VLLM_CASES[case]
    return EngineArgs(model=model_dir(root, name), skip_tokenizer_init=True, **kwargs).create_engine_config()


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


def scratch() -> Path:
    """A folder for the model config.json files (under $TMPDIR)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="warmreg-engines-", dir=os.environ.get("TMPDIR")))
