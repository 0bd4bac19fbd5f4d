"""What RecoverSSM (``serving.use_replayssm`` with speculation) changes in the rest of a Kimi-K3 plan, against vLLM
0.34's code: the keys the KDA layer and its metadata builder launch on cuda:90 and cuda:100 with it on and off.

The example (``examples/kimi_k3.json``): 12 KDA heads a rank, head dim 128 (``P = 1536``, conv dim ``3P = 4608``), 3
speculative tokens, bf16, TP 8 with hidden 7168 (the projection-overlap path's ``4P = 6144`` rows feed plain decodes
on both SMs), the packed projection row ``6288`` wide.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from warmreg_kimi_k3 import causal_conv1d, causal_conv1d_update, kda_spec_metadata
from warmreg_kimi_k3.backends import kda_layout, kda_spec_decode_backend
from warmreg_kimi_k3.model import KimiK3
from warmreg_kimi_k3.recoverssm import state_slots

import warmreg
from warmreg.testing import RegisterPlugin, assert_warmup_inputs_reproduce, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
RECURRENT, UPDATE = "kimi_k3.kda_recurrent", "kimi_k3.causal_conv1d_update"
STAGE, PREFILL_CONV = "kimi_k3.stage_spec_decode_metadata", "kimi_k3.causal_conv1d"
TARGETS = ["cuda:90", "cuda:100"]


def _config(**serving: Any) -> warmreg.WarmConfig:
    return warmreg.WarmConfig.load(example_config("kimi_k3", **serving))


def _plan(target: str, **serving: Any) -> dict[str, warmreg.KernelPlan]:
    return {kp.name: kp for kp in warmreg.plan(_config(**serving), target=target).kernels}


def _update_keys(kp: warmreg.KernelPlan) -> set[tuple[Any, ...]]:
    """(speculative, index stride, one-token row stride or 0 for varlen, varlen row class) of each conv-update key."""
    return {(k.is_spec_decoding, k.stride_state_indices, k.stride_x_seq, str(k.stride_x_token)) for k in kp.keys}


def test_state_slots() -> None:
    """vLLM 0.34: ``num_speculative_blocks = 0 if use_replayssm else num_speculative_tokens``
    (``model_executor/layers/mamba/abstract.py: MambaBase.get_kv_cache_spec``); the builder's ``spec_state_slots =
    1 if self.use_recoverssm else self.num_spec + 1`` (``models/kimi_k3/nvidia/kda_metadata.py``)."""
    for on, slots in ((False, 4), (True, 1)):
        config = _config(use_replayssm=on)
        layout = kda_layout(KimiK3.from_config(config), config)
        assert layout is not None and state_slots(config, layout) == slots


@pytest.mark.parametrize("target", TARGETS)
def test_recurrent_step_only_without_recoverssm(target: str) -> None:
    """``KimiK3DeltaAttention._forward`` (``models/kimi_k3/nvidia/kda.py``), spec-decode path: ``if
    self.use_recoverssm: core_attn_out_spec = self._recoverssm_verify(...) else: ... fused_recurrent_kda(...)``; plain
    decodes run ``fused_recurrent_kda_packed_decode``: with RecoverSSM nothing launches the recurrent step."""
    assert len(_plan(target)[RECURRENT].keys) == 3  # vLLM's three tile buckets that 1..256 sequences reach
    assert RECURRENT not in _plan(target, use_replayssm=True)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("on", [False, True])
def test_conv_update_keys(target: str, on: bool) -> None:
    """Speculative rows: ``causal_conv1d_update(..., conv_state_indices=spec_state_indices_tensor[:, 0][:n],
    max_query_len=spec_state_indices_tensor.size(-1))`` off, ``_recoverssm_verify``'s ``conv_state_indices=
    m.spec_state_indices_tensor[:n, 0], max_query_len=self.spec_query_len`` on: the index stride is the builder's
    row width, 4 or 1 (a block-table view, its gathered rows or the staged graph buffer, all that wide). Plain
    decodes (``non_spec_state_indices_tensor[:B]``): ``block_table[:, 0]`` (the block-table width) or the staged
    ``[max_bs]`` buffer (1), on the projection's 6288-wide rows or the overlap path's 6144-wide ones."""
    slots = 1 if on else 4
    plain = {(False, stride, row, "one") for stride in {1, slots} for row in (6144, 6288)}
    assert _update_keys(_plan(target, use_replayssm=on)[UPDATE]) == {(True, slots, 0, "div16")} | plain
    (spec,) = (k for k in _plan(target, use_replayssm=on)[UPDATE].keys if k.is_spec_decoding)
    assert (spec.seqlen, spec.state_len, spec.np2_statelen) == (4, 6, 8)  # max_query_len 1 + spec either way


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("on", [False, True])
def test_staging_and_prefill_conv_keys(target: str, on: bool) -> None:
    """``stage_spec_decode_metadata`` stages into the builder's ``spec_state_indices_tensor``: GDN's
    ``[decode_cudagraph_max_bs, num_spec + 1]`` off, ``torch.empty((max_num_reqs, 1))`` on (``NUM_STATE_SLOTS =
    staged_state_indices.shape[1]``). The prefill conv's ``cache_indices`` are ``block_table[:, 0]`` (the block-table
    width) or, beside speculative rows, ``block_table[active_non_spec_mask_cpu, 0]`` (a copy: 1)."""
    kps = _plan(target, use_replayssm=on)
    ((stage,),) = (kps[STAGE].keys,)
    assert (stage.num_state_slots, stage.block_state_slots) == ((1, 1) if on else (4, 4))
    assert {k.stride_cache_indices for k in kps[PREFILL_CONV].keys} == ({1} if on else {1, 4})


@pytest.mark.parametrize(
    ("target", "on", "expected"),
    [("cuda:100+flashinfer", False, "flashinfer"), ("cuda:100+flashinfer", True, "native"),
     ("cuda:103+flashinfer", True, "native"), ("cuda:90", True, "native")],
)  # fmt: skip
def test_flashinfer_spec_decode_needs_recoverssm_off(target: str, on: bool, expected: str) -> None:
    """``is_flashinfer_fused_kda_spec_decode_supported(..., use_recoverssm)`` requires ``not use_recoverssm``."""
    config = _config(use_replayssm=on)
    assert kda_spec_decode_backend(KimiK3.from_config(config), config, warmreg.Platform.parse(target)) == expected


def test_recoverssm_without_drafts_is_refused_by_every_reader() -> None:
    """Kimi-K3's KDA layer raises for ``--use-replayssm`` without speculation: so does each module that asks."""
    config = _config(use_replayssm=True, num_speculative_tokens=0)
    platform = warmreg.Platform.parse("cuda:100+flashinfer")
    with pytest.raises(warmreg.ConfigError, match="use_replayssm"):
        kda_spec_decode_backend(KimiK3.from_config(config), config, platform)
    with pytest.raises(warmreg.ConfigError, match="use_replayssm"):
        warmreg.plan(config, target="cuda:90")


@pytest.mark.parametrize("target", TARGETS)
def test_recoverssm_keys_warm(target: str) -> None:
    """The keys RecoverSSM adds (one-slot indices) reproduce from their warmup inputs and compile for the target."""
    plugin = RegisterPlugin(causal_conv1d_update.register, kda_spec_metadata.register, causal_conv1d.register,
                            model=KimiK3.from_config)  # fmt: skip
    kps = {kp.name: kp for kp in warmreg.plan(_config(use_replayssm=True), target=target, plugins=[plugin],
                                              entry_points=False).kernels}  # fmt: skip
    assert set(kps) == {UPDATE, STAGE, PREFILL_CONV}
    for kp in kps.values():
        assert_warmup_inputs_reproduce(kp.kernel, kp.keys)
    report = warmreg.warm(_config(use_replayssm=True), target=target, plugins=[RegisterPlugin(
        causal_conv1d_update.register, kda_spec_metadata.register, model=KimiK3.from_config)], entry_points=False,
        workers=1)  # fmt: skip
    assert report.ok and {r.kernel for r in report.results} == {UPDATE, STAGE}, [r.error for r in report.failed]
