"""Hostile values in the engines' config objects and in ``--set`` (issue 40, points 12 and 7): each is one
ConfigError naming the engine field (or ``--set NAME``), the value and the fix. No value is read as something
else (a bool as an int, a list as its repr, ``-1`` as a dtype) and no setting is dropped for want of a
readable value; the CLI prints the error as one line and exits 2.

The engine objects are the recorded ``VllmConfig`` and ``ServerArgs`` snapshots of ``tests/engines/snapshots/``
rebuilt as plain objects, as ``tests/test_engine_configs.py`` rebuilds them, with one attribute made hostile.
"""

from __future__ import annotations

import copy
import enum
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import warmreg
from tests.reliability.hostile import assert_refused, run_cli
from warmreg import ConfigError, WarmConfig
from warmreg.contract.config import SERVING_FIELDS
from warmreg.engines import SGLANG_FIELDS, VLLM_PATHS

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "tests" / "engines" / "snapshots"
FLASH = ROOT / "examples" / "deepseek_v4_flash.json"
NAN = float("nan")


class _HfConfig:
    """A Hugging Face config stand-in: ``to_dict()`` returns (a copy of) ``values``."""

    def __init__(self, values: Any) -> None:
        self.values = values

    def to_dict(self) -> Any:
        return copy.deepcopy(self.values)


def _recorded(value: Any) -> Any:
    if isinstance(value, dict) and "__enum__" in value:
        return enum.Enum(value["__enum__"], {value["name"]: value["value"]})[value["name"]]
    if isinstance(value, dict) and "__dtype__" in value:
        return getattr(torch, value["__dtype__"])
    return value


_RECORDED = object()


def engine(name: str, *, hf: Any = _RECORDED, **changes: Any) -> Any:
    """The recorded object ``name`` (``vllm-flash``, ``sglang-flash_eagle``) with attributes changed (dotted
    paths) and, given ``hf``, that as its hf_config's ``to_dict()``."""
    snap = json.loads((SNAPSHOTS / f"{name}.json").read_text())
    root = type(snap["type"], (), {})()
    attributes = {k: _recorded(v) for k, v in snap["attributes"].items()} | changes
    attributes[snap["hf_config_at"]] = _HfConfig(snap["hf_config"]["to_dict"] if hf is _RECORDED else hf)
    for path, value in attributes.items():
        obj = root
        *parents, leaf = path.split(".")
        for part in parents:
            if getattr(obj, part, None) is None:
                setattr(obj, part, type(part, (), {})())
            obj = getattr(obj, part)
        setattr(obj, leaf, value)
    return root


def _refused(obj: Any, field: str, value: Any) -> ConfigError:
    """Loading ``obj`` is one ConfigError naming the engine ``field``, the ``value`` and a fix."""
    with pytest.raises(ConfigError) as info:
        WarmConfig.load(obj)
    text = str(info.value)
    assert field in text and repr(value) in text and "fix:" in text, text
    return info.value


# -- vLLM ----------------------------------------------------------------------------------------------

_INTS = {"True": True, "NaN": NAN, "'2'": "2", "2.0": 2.0, "[2]": [2]}
_NAMES = {"['x']": ["x"], "7": 7, "NaN": NAN, "True": True}
_DTYPES = {"-1": -1, "'Tensor'": "Tensor", "'e'": "e", "['bfloat16']": ["bfloat16"], "True": True}
_VLLM_INT_PATHS = sorted(p for n, p in VLLM_PATHS.items() if SERVING_FIELDS[n][0](1) is None)  # the int settings
_FLAGS = {"1": 1, "'true'": "true", "[True]": [True], "NaN": NAN}
_VLLM_FLAG_PATHS = sorted(p for n, p in VLLM_PATHS.items() if SERVING_FIELDS[n][0](True) is None)  # the bool settings
_VLLM_NAME_PATHS = sorted(set(VLLM_PATHS.values()) - {*_VLLM_INT_PATHS, *_VLLM_FLAG_PATHS, VLLM_PATHS["dtype"]})
VLLM_CASES = (
    [(f"int: {p} = {v}", "vllm-flash", p, _INTS[v]) for p in _VLLM_INT_PATHS for v in _INTS]
    + [(f"name: {p} = {v} ({case})", case, p, _NAMES[v]) for p in _VLLM_NAME_PATHS for v in _NAMES for case in ("vllm-flash", "vllm-kimi_k3")]
    + [(f"dtype: model_config.dtype = {v}", "vllm-flash", "model_config.dtype", _DTYPES[v]) for v in _DTYPES]
    + [(f"flag: {p} = {v}", "vllm-kimi_k3", p, _FLAGS[v]) for p in _VLLM_FLAG_PATHS for v in _FLAGS]
)  # fmt: skip


@pytest.mark.parametrize(("name", "snapshot", "path", "value"), VLLM_CASES, ids=[c[0] for c in VLLM_CASES])
def test_hostile_vllm_value(name: str, snapshot: str, path: str, value: Any) -> None:
    """a VllmConfig value of the wrong type (list, int, NaN, bool for an int or a name, -1 for a dtype, an int or a string for a flag) is a ConfigError naming its field"""
    _refused(engine(snapshot, **{path: value}), f"VllmConfig.{path}", value)


def test_a_vllm_list_backend_or_cache_name_is_never_read_as_its_repr() -> None:
    """a list-valued cache dtype of a non-DeepSeek model is refused, not read as the string "['fp8']" """
    error = _refused(
        engine("vllm-kimi_k3", **{"cache_config.cache_dtype": ["fp8"]}), "VllmConfig.cache_config.cache_dtype", ["fp8"]
    )
    assert error.field == "VllmConfig.cache_config.cache_dtype"


# -- SGLang --------------------------------------------------------------------------------------------

_SGLANG_INT_FIELDS = ("chunked_prefill_size", "max_running_requests", "context_length", "page_size", "tp_size", "dcp_size",
                      "speculative_num_draft_tokens")  # fmt: skip
SGLANG_CASES = (
    [(f"int: {f} = {v}", "sglang-flash_eagle", f, _INTS[v]) for f in _SGLANG_INT_FIELDS for v in _INTS]
    + [(f"name: {f} = {v}", "sglang-flash_eagle", f, _NAMES[v]) for f in sorted(set(SGLANG_FIELDS) - set(_SGLANG_INT_FIELDS)) for v in _NAMES]
    + [(f"dtype: model_config.dtype = {v}", "sglang-flash_defaults", "model_config.dtype", _DTYPES[v]) for v in _DTYPES]
    + [(f"int: model_config.context_len = {v}", "sglang-flash_defaults", "model_config.context_len", _INTS[v]) for v in _INTS]
)  # fmt: skip


@pytest.mark.parametrize(("name", "snapshot", "field", "value"), SGLANG_CASES, ids=[c[0] for c in SGLANG_CASES])
def test_hostile_sglang_value(name: str, snapshot: str, field: str, value: Any) -> None:
    """a ServerArgs value of the wrong type (list, NaN, "2", 2.0, bool for an int, an int for a name) is a ConfigError naming its field"""
    _refused(engine(snapshot, **{field: value}), f"ServerArgs.{field}", value)


def test_sglang_dcp_size_true_is_not_one() -> None:
    """dcp_size=True is refused, not read as DCP off"""
    error = _refused(engine("sglang-flash_eagle", dcp_size=True), "ServerArgs.dcp_size", True)
    assert error.field == "ServerArgs.dcp_size" and "bool" in str(error)


@pytest.mark.parametrize("drafts", ["2", 2.0, NAN, True, [2]], ids=repr)
def test_sglang_draft_tokens_of_the_wrong_type_are_refused_not_dropped(drafts: Any) -> None:
    """speculative_num_draft_tokens that is not an int is refused (dropping it planned DeepSeek-V4-Flash without its speculative keys)"""
    error = _refused(
        engine("sglang-flash_eagle", speculative_num_draft_tokens=drafts),
        "ServerArgs.speculative_num_draft_tokens",
        drafts,
    )
    assert error.field == "ServerArgs.speculative_num_draft_tokens"


def test_sglang_speculation_without_draft_tokens_stops_the_plan() -> None:
    """an EAGLE ServerArgs whose speculative_num_draft_tokens is unset plans nothing: the plan names the field"""
    cfg = WarmConfig.load(engine("sglang-flash_eagle", speculative_num_draft_tokens=None))
    assert (
        "num_speculative_tokens" not in cfg.serving
        and "ServerArgs.speculative_num_draft_tokens = None" in cfg.unmapped["num_speculative_tokens"]
    )
    with pytest.raises(ConfigError, match=r"ServerArgs\.speculative_num_draft_tokens = None") as info:
        warmreg.plan(engine("sglang-flash_eagle", speculative_num_draft_tokens=None), target="cuda:90")
    assert info.value.field == "serving.num_speculative_tokens" and "fix:" in str(info.value)


# -- the model's hf_config -----------------------------------------------------------------------------

_MODEL = json.loads((SNAPSHOTS / "vllm-flash.json").read_text())["hf_config"]["to_dict"]
HF_CASES = {
    "to_dict() a list": ([1, 2], "to_dict()", [1, 2]),
    "to_dict() a list of pairs": ([["model_type", "deepseek_v4"]], "to_dict()", [["model_type", "deepseek_v4"]]),
    "to_dict() None": (None, "to_dict()", None),
    "architectures an int": ({**_MODEL, "architectures": 5}, "architectures", 5),
    "architectures a string": (
        {**_MODEL, "architectures": "DeepseekV4ForCausalLM"},
        "architectures",
        "DeepseekV4ForCausalLM",
    ),
    "architectures of ints": ({**_MODEL, "architectures": [5]}, "architectures", [5]),
    "architectures a dict": ({**_MODEL, "architectures": {"a": 1}}, "architectures", {"a": 1}),
}


@pytest.mark.parametrize("engine_name", ["vllm-flash", "sglang-flash_eagle"])
@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_malformed_hf_config(name: str, engine_name: str) -> None:
    """a malformed hf_config (to_dict() not a mapping, architectures not a list of names) is a ConfigError naming it"""
    hf, part, value = HF_CASES[name]
    obj = engine(engine_name, hf=hf)
    error = _refused(obj, part, value)
    assert error.field.startswith(f"{type(obj).__name__}.") and "hf_config" in error.field


def test_a_hugging_face_config_whose_to_dict_is_not_a_mapping() -> None:
    """a PretrainedConfig-like object whose to_dict() returns a list is a ConfigError, not an AttributeError"""
    hf = type("DeepseekV4Config", (), {"model_type": "deepseek_v4", "to_dict": lambda self: [1, 2]})()
    with pytest.raises(ConfigError, match=r"'model'.*\(1, 2\)|'model'.*\[1, 2\]") as info:
        WarmConfig.load(hf)
    assert "DeepseekV4Config" in str(info.value) and "fix:" in str(info.value)


@pytest.mark.parametrize("dtype", ["nan", "e", "Tensor", "float8_e4m3fn", "int32", "auto"])
def test_serving_dtype_is_an_activation_dtype(dtype: str) -> None:
    """serving.dtype names an activation dtype, never another attribute of torch (nan, e, Tensor)"""
    with pytest.raises(ConfigError) as info:
        WarmConfig.load({"model": {"model_type": "deepseek_v4"}, "serving": {"dtype": dtype}})
    assert info.value.field == "serving.dtype" and repr(dtype) in str(info.value) and "bfloat16" in str(info.value)


# -- the command line's --set ----------------------------------------------------------------------------

SET_CASES = {
    "dtype: nan": "dtype=nan",
    "dtype: e": "dtype=e",
    "dtype: Tensor": "dtype=Tensor",
    "dtype: NaN": "dtype=NaN",
    "dtype: a list": "dtype=[1]",
    "dtype: true": "dtype=true",
    "dtype: empty": "dtype=",
    "int: zero": "max_num_seqs=0",
    "int: true": "max_num_seqs=true",
    "int: NaN": "max_num_seqs=NaN",
    "int: a float": "max_num_seqs=8.0",
    "int: a string": "max_model_len=big",
    "name: unknown setting": "max_batch=8",
    "name: a list": 'kv_cache_dtype=["fp8"]',
}


@pytest.mark.parametrize("name", sorted(SET_CASES))
def test_a_bad_set_value_is_blamed_on_set(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """a bad --set value is one line naming --set NAME (not the config file) and how to write it there; exit 2"""
    setting = SET_CASES[name]
    key = setting.partition("=")[0]
    outcome = run_cli(capsys, "plan", str(FLASH), "--target", "cuda:90", "--set", setting)
    assert_refused(outcome, rf"--set {key}\b")
    line = outcome.lines[0]
    assert f"serving.{key}" in line and "fix: write --set " in line and str(FLASH) not in line, line


def test_a_set_value_a_plugin_refuses_names_set(capsys: pytest.CaptureFixture[str]) -> None:
    """a --set value the core accepts and a plugin refuses (a cache name it does not know) is one line naming --set NAME"""
    outcome = run_cli(capsys, "plan", str(FLASH), "--target", "cuda:90", "--set", "kv_cache_dtype=fp8_e5m2")
    assert_refused(outcome, r"serving\.kv_cache_dtype' is 'fp8_e5m2'.*\(--set kv_cache_dtype=fp8_e5m2\)")
