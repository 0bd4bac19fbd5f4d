"""Engine config objects read into warmreg's canonical settings, without the engines installed.

The objects are rebuilt from attribute snapshots that ``scripts/record_engine_snapshots.py`` recorded
from real vLLM 0.33.0 ``VllmConfig`` and SGLang 0.5.23 ``ServerArgs`` objects
(``tests/engines/snapshots/``; regenerate with ``bash scripts/engine-envs.sh record``): plain objects
holding exactly the recorded attributes, with the recorded hf_config's ``to_dict()``. The same
deployments with the real classes are ``tests/engines/`` (run in the engines' venvs).
"""

from __future__ import annotations

import ast
import copy
import enum
import json
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import warmreg
from warmreg import ConfigError, WarmConfig, engines

ENGINES = Path(__file__).resolve().parent / "engines"
sys.path.insert(0, str(ENGINES))

import cases  # noqa: E402
from warmreg_deepseek_v4.backends import kv_cache_layout  # noqa: E402
from warmreg_deepseek_v4.dspark import num_speculative_tokens  # noqa: E402
from warmreg_deepseek_v4.model import DSV4, FP8_QUANT_METHODS, fp8_checkpoint, kv_cache_dtype  # noqa: E402
from warmreg_deepseek_v4.sparse_mla import attention_backend  # noqa: E402
from warmreg_kimi_k3.backends import kda_layout, kv_block_size  # noqa: E402
from warmreg_kimi_k3.model import KimiK3  # noqa: E402

SNAPSHOTS = ENGINES / "snapshots"


def _value(recorded: Any) -> Any:
    if isinstance(recorded, dict) and "__enum__" in recorded:
        return enum.Enum(recorded["__enum__"], {recorded["name"]: recorded["value"]})[recorded["name"]]
    if isinstance(recorded, dict) and "__dtype__" in recorded:
        return getattr(torch, recorded["__dtype__"])
    return recorded


def _plain(type_name: str) -> Any:
    return type(type_name, (), {})()


def _hf(recorded: dict[str, Any]) -> Any:
    """The recorded hf_config: its class name, its ``to_dict()``, its top-level values as attributes."""
    values = recorded["to_dict"]
    cls = type(recorded["__class__"].rsplit(".", 1)[-1], (), {"to_dict": lambda self: copy.deepcopy(values)})
    obj = cls()
    for key, value in values.items():
        setattr(obj, key, value)
    return obj


def snapshot(name: str, **changes: Any) -> Any:
    """The recorded object ``<engine>-<case>``, with recorded attributes changed (dotted paths)."""
    snap = json.loads((SNAPSHOTS / f"{name}.json").read_text())
    attributes = {**{k: _value(v) for k, v in snap["attributes"].items()}, **changes}
    root = _plain(snap["type"])
    attributes[snap["hf_config_at"]] = _hf(snap["hf_config"])
    for path, value in attributes.items():
        obj = root
        *parents, leaf = path.split(".")
        for part in parents:
            if getattr(obj, part, None) is None:
                setattr(obj, part, _plain(part))
            obj = getattr(obj, part)
        setattr(obj, leaf, value)
    return root


VLLM = sorted(p.stem.split("-", 1)[1] for p in SNAPSHOTS.glob("vllm-*.json"))
SGLANG = sorted(p.stem.split("-", 1)[1] for p in SNAPSHOTS.glob("sglang-*.json"))


def test_a_snapshot_of_every_case_is_recorded() -> None:
    assert VLLM == sorted(cases.VLLM_CASES) and SGLANG == sorted(cases.SGLANG_CASES)


#: Settings vLLM states that the examples leave to the same default: DCP off (1, 1), the indexer format auto.
VLLM_STATED_DEFAULTS = {"decode_context_parallel_size": 1, "cp_kv_cache_interleave_size": 1, "indexer_kv_dtype": "auto"}


@pytest.mark.parametrize("case", VLLM)
def test_vllm_config_reads_as_the_deployments_json(case: str) -> None:
    cfg = WarmConfig.load(snapshot(f"vllm-{case}"), serving=cases.gpu_serving(case))
    want = WarmConfig.load(cases.expected_vllm(case))
    # the CPU-aligned and defaulted settings are compared as the plugins read them, below
    skip = {*VLLM_STATED_DEFAULTS, *cases.VLLM_CPU_ALIGNED.get(case, ()), *cases.VLLM_DEFAULTED.get(case, ())}
    read = {k: v for k, v in cfg.serving.items() if k not in skip}
    assert read == {k: v for k, v in want.serving.items() if k not in skip}
    assert {k: cfg.serving[k] for k in VLLM_STATED_DEFAULTS} == VLLM_STATED_DEFAULTS
    assert not cfg.unmapped and cfg.source == "VllmConfig"
    if cfg.model_type == "kimi_k3":
        m = KimiK3.from_config(cfg)
        assert m == KimiK3.from_config(want) and kda_layout(m, cfg) == kda_layout(m, want)
        assert cfg.serving["block_size"] == 16 and kv_block_size(m, cfg) == kv_block_size(m, want) == 768
    else:
        # transformers' DeepseekV4Config lists the main and MTP layers' ratios; the legacy list of a DSpark checkpoint
        # also lists its draft layers, which vLLM builds with ratio 1 whatever it says (warmreg_deepseek_v4.dspark)
        got, example = DSV4.from_config(cfg), DSV4.from_config(want)
        n = len(got.ratios)
        assert got == attrs.evolve(example, ratios=example.ratios[:n]) and set(example.ratios[n:]) <= {1}
        assert num_speculative_tokens(cfg) == num_speculative_tokens(want)


@pytest.mark.parametrize("case", SGLANG)
def test_sglang_server_args_read_as_the_deployments_json(case: str) -> None:
    cfg = WarmConfig.load(snapshot(f"sglang-{case}"))
    want = WarmConfig.load(cases.expected_sglang(case))
    assert dict(cfg.serving) == dict(want.serving)
    assert not cfg.unmapped and cfg.source == "ServerArgs"
    assert DSV4.from_config(cfg) == DSV4.from_config(want)


def test_sglang_eagle_plans_the_keys_of_its_json() -> None:
    def keys(config: Any) -> set[Any]:
        return {(kp.name, key) for kp, key in warmreg.plan(config, target=cases.TARGET).items()}

    assert keys(snapshot("sglang-flash_eagle")) == keys(cases.expected_sglang("flash_eagle"))


def test_vllm_enum_backend_and_rename_are_read() -> None:
    vc = snapshot("vllm-flash")
    assert isinstance(vc.attention_config.backend, enum.Enum)  # as vLLM holds it
    cfg = WarmConfig.load(vc)
    assert attention_backend(cfg) == "FLASHMLA_SPARSE_DSV4" and cfg.serving["dtype"] == "bfloat16"
    assert "AttentionBackendEnum.FLASHMLA_SPARSE_DSV4" in cfg.origins["attention_backend"]
    # vLLM's in-place rename of the FP8 checkpoint's quant_method is still an FP8 checkpoint
    assert cfg.model["quantization_config"]["quant_method"] == "deepseek_v4_fp8"
    assert fp8_checkpoint(cfg) and DSV4.from_config(cfg).fp8_checkpoint


def test_vllm_indexer_format_and_kda_backends_are_read_from_their_config_paths() -> None:
    # AttentionConfig.indexer_kv_dtype is a field; --kda-*-backend land in the additional_config dict
    vc = snapshot(
        "vllm-flash",
        **{"attention_config.indexer_kv_dtype": "mxfp4", "additional_config": {"kda_prefill_backend": "triton"}},
    )
    cfg = WarmConfig.load(vc)
    assert cfg.serving["indexer_kv_dtype"] == "mxfp4" and cfg.serving["kda_prefill_backend"] == "triton"
    assert "kda_decode_backend" not in cfg.serving  # unset in the dict: not a setting
    assert "additional_config.kda_prefill_backend" in cfg.origins["kda_prefill_backend"]


def test_sglang_counts_and_names_map_onto_canonical_ones() -> None:
    sa = snapshot("sglang-flash_eagle")
    assert (sa.speculative_num_draft_tokens, sa.kv_cache_dtype, sa.attention_backend) == (2, "fp8_e4m3", "dsv4")
    cfg = WarmConfig.load(sa)
    assert cfg.serving["num_speculative_tokens"] == 1 and cfg.serving["speculative_method"] == "mtp"
    assert kv_cache_dtype(cfg) == "fp8_ds_mla" and attention_backend(cfg) == "FLASHMLA_SPARSE_DSV4"
    assert cfg.origins["num_speculative_tokens"] == "ServerArgs.speculative_num_draft_tokens = 2, read as 1"
    dspark = WarmConfig.load(snapshot("sglang-flash_dspark"))
    assert (dspark.serving["num_speculative_tokens"], dspark.serving["speculative_method"]) == (3, "dspark")
    # EAGLE with a draft model of its own is vLLM's eagle, not the checkpoint's MTP
    other = WarmConfig.load(snapshot("sglang-flash_eagle", speculative_draft_model_path="/models/draft"))
    assert other.serving["speculative_method"] == "eagle"


def test_sglang_context_length_none_and_dtype_auto_come_from_its_model_config() -> None:
    sa = snapshot("sglang-flash_defaults")
    assert sa.context_length is None and sa.dtype == "auto"
    cfg = WarmConfig.load(sa)
    assert cfg.serving["max_model_len"] == 1048576 and cfg.serving["dtype"] == "bfloat16"
    bare = snapshot("sglang-flash_defaults", **{"model_config.dtype": None, "model_config.context_len": None})
    with pytest.raises(ConfigError, match=r"ServerArgs\.dtype = 'auto'"):
        WarmConfig.load(bare).get("serving.dtype", str, plugin="p")
    with pytest.raises(ConfigError, match=r"serving\.max_model_len' is missing"):
        WarmConfig.load(bare).get("serving.max_model_len", int, plugin="p")


def test_the_engines_dtype_aliases_read_as_torch_names() -> None:
    # SGLang's --dtype half and float (vLLM's too, before its ModelConfig resolves them) are torch's float16 and float32
    cfg = WarmConfig.load(snapshot("sglang-flash_eagle", dtype="half"))
    assert cfg.serving["dtype"] == "float16" and cfg.origins["dtype"] == "ServerArgs.dtype = 'half', read as 'float16'"
    for raw, name in ((torch.float32, "float32"), ("float", "float32"), ("float16", "float16")):
        assert WarmConfig.load(snapshot("vllm-flash", **{"model_config.dtype": raw})).serving["dtype"] == name


@pytest.mark.parametrize(
    ("name", "changes", "field", "words"),
    [
        ("sglang-flash_eagle", {"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype", ["ServerArgs.kv_cache_dtype = 'fp8_e5m2'", "fp8_e4m3"]),
        ("sglang-flash_eagle", {"dsv4_attn_backend": "trtllm"}, "attention_backend", ["('dsv4', 'trtllm')", "dsv4 with dsv4_attn_backend flashmla"]),
        ("sglang-flash_eagle", {"decode_attention_backend": "flashmla"}, "attention_backend", ["('dsv4', 'flashmla')", "one backend"]),
        ("sglang-flash_eagle", {"chunked_prefill_size": -1}, "max_num_batched_tokens", ["ServerArgs.chunked_prefill_size = -1"]),
        ("sglang-flash_eagle", {"speculative_algorithm": "LOOKAHEAD"}, "speculative_method", ["'LOOKAHEAD'", "DSPARK"]),
        ("vllm-flash", {"attention_config.backend": "FLASHINFER_MLA_SPARSE"}, "attention_backend", ["VllmConfig.attention_config.backend = 'FLASHINFER_MLA_SPARSE'", "vLLM refuses"]),
        ("vllm-flash", {"cache_config.cache_dtype": "bfloat16"}, "kv_cache_dtype", ["VllmConfig.cache_config.cache_dtype = 'bfloat16'", "fp8_ds_mla"]),
    ],
)  # fmt: skip
def test_an_engine_value_without_a_canonical_counterpart_names_field_and_value(
    name: str, changes: dict[str, Any], field: str, words: list[str]
) -> None:
    cfg = WarmConfig.load(snapshot(name, **changes))
    assert field not in cfg.serving
    with pytest.raises(ConfigError) as info:
        cfg.get(f"serving.{field}", str, plugin="warmreg-deepseek-v4", default="x")  # a default does not hide it
    assert info.value.field == f"serving.{field}" and all(w in str(info.value) for w in words), str(info.value)
    # passing the canonical value explicitly is the way out
    canonical = cases.example("deepseek_v4_flash")["serving"][field]
    fixed = WarmConfig.load(snapshot(name, **changes), serving={field: canonical})
    assert fixed.get(f"serving.{field}", type(canonical), plugin="p") == canonical and field not in fixed.unmapped


def test_a_canonical_value_a_plugin_refuses_names_the_engine_field() -> None:
    # FlashInfer's DeepSeek-V4 backend keeps vLLM's cache name; fp8_e5m2 is not one the plugin knows
    cfg = WarmConfig.load(snapshot("vllm-pro_flashinfer", **{"cache_config.cache_dtype": "fp8_e5m2"}))
    with pytest.raises(ConfigError) as info:
        kv_cache_dtype(cfg)
    assert "VllmConfig.cache_config.cache_dtype = 'fp8_e5m2'" in str(info.value) and "fp8_ds_mla" in str(info.value)
    # fp8_ds_mla is a name the plugin knows, which FlashInfer's backend refuses on SM10x: the error names the target
    cfg = WarmConfig.load(snapshot("vllm-pro_flashinfer", **{"cache_config.cache_dtype": "fp8_ds_mla"}))
    with pytest.raises(ConfigError) as info:
        kv_cache_layout(cfg, warmreg.Platform.parse("cuda:100"))
    assert "VllmConfig.cache_config.cache_dtype = 'fp8_ds_mla'" in str(info.value) and "cuda:100" in str(info.value)


def test_flashinfer_on_sm10x_plans_the_plain_fp8_layout() -> None:
    """The real Pro-on-FlashInfer object with its 'fp8' cache: no fp8_ds_mla gather, the indexer pages aligned to 512
    (not 576), and it plans what the JSON of the same deployment plans on cuda:100."""
    vc = snapshot("vllm-pro_flashinfer")
    got = warmreg.plan(vc, target="cuda:100", serving=cases.gpu_serving("pro_flashinfer"))
    want = warmreg.plan(cases.expected_vllm("pro_flashinfer"), target="cuda:100")
    assert {(k.name, key) for k, key in got.items()} == {(k.name, key) for k, key in want.items()}
    assert "deepseek_v4.dequant_gather_k_cache" not in {k.name for k in got.kernels}
    (stride,) = {key.kv_block_stride for key in got.kernel("deepseek_v4.indexer_kv_compress_insert").keys}
    assert stride % 512 == 0 and stride % 576 != 0  # 64 tokens of 132 bytes: 8704, where fp8_ds_mla pages give 8640


def test_kimi_block_size_of_a_cpu_built_config_is_the_one_vllm_runs() -> None:
    """vLLM's CPU platform forced Kimi-K3's block size to 16; the plugin raises it to the 768 a GPU runs, as from
    the example's 768 and from the requested 64, so the slot mapping is planned at 768."""
    vc = snapshot("vllm-kimi_k3")
    assert vc.cache_config.block_size == 16
    got = warmreg.plan(vc, target=cases.TARGET, serving=cases.gpu_serving("kimi_k3"))
    (key,) = got.kernel("warmreg.ops.block_table_slot_mapping").keys
    assert key.block_size == 768
    for block in (16, 64, 768):
        config = cases.with_serving(cases.expected_vllm("kimi_k3"), {"block_size": block})
        assert warmreg.plan(config, target=cases.TARGET).kernel("warmreg.ops.block_table_slot_mapping").keys == (key,)


def test_vllm_defaults_are_what_vllm_runs_for_deepseek_v4() -> None:
    vc = snapshot("vllm-flash_defaults")
    assert vc.attention_config.backend is None and vc.cache_config.cache_dtype == "auto"
    cfg = WarmConfig.load(vc)
    assert cfg.serving["attention_backend"] == "FLASHMLA_SPARSE_DSV4" and cfg.serving["kv_cache_dtype"] == "fp8_ds_mla"


@pytest.mark.parametrize("name", ["vllm-flash", "sglang-flash_eagle"])
def test_fp8_checkpoint_on_every_form_the_engines_hand_over(name: str) -> None:
    hf = _hf(json.loads((SNAPSHOTS / f"{name}.json").read_text())["hf_config"])
    published = cases.example("deepseek_v4_flash")["model"]
    assert fp8_checkpoint(hf) and fp8_checkpoint(hf.to_dict()) and fp8_checkpoint(published)
    assert hf.quantization_config["quant_method"] in FP8_QUANT_METHODS
    unquantized = {k: v for k, v in published.items() if k != "quantization_config"}
    assert not fp8_checkpoint(unquantized) and not fp8_checkpoint(WarmConfig.load(unquantized))
    with pytest.raises(ConfigError, match="quantization_config"):
        fp8_checkpoint({**published, "quantization_config": "fp8"})


def test_engines_module_imports_only_the_standard_library_attrs_and_errors() -> None:
    """The engine readers import no engine and no torch at import time (an engine's module is imported
    only to read an object of that engine)."""
    allowed = {"__future__", "enum", "importlib", "collections.abc", "types", "typing", "attrs", "..values.errors"}
    for path in sorted(Path(engines.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {("." * n.level) + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        siblings = {f".{p.stem}" for p in path.parent.glob("*.py")}
        assert names <= allowed | siblings, f"{path.name}: {sorted(names - allowed - siblings)}"
