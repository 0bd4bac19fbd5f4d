"""The fused MXFP4 prologue of a DSA layer under Triton's interpreter: its e4m3fn encoder against torch's casts,
the two RMSNorms, the fp8_ds_mla entries, the MXFP4 key insert and the top-k fill against the PyTorch references,
profile runs without caches, strided views, errors and ``out=``. The plan is in ``test_dsa_mxfp4_plan.py``.

Tolerance: ``q_out`` / ``kv_out`` one bf16 step (the kernel sums in the interpreter's order, torch in its own);
the fp8_ds_mla entries exactly, against the reference applied to the kernel's own ``kv_out``; the MXFP4 key bytes
as in ``test_dsa_mxfp4_k_insert.py`` (scales exact, nibbles one code apart at most, nearly all equal).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
import triton
import triton.language as tl
from warmreg_kimi_k3._mxfp4 import entry_bytes
from warmreg_kimi_k3.dsa_mxfp4_k_insert import mxfp4_key_insert_reference
from warmreg_kimi_k3.dsa_mxfp4_prologue import (
    MXFP4Prologue,
    e4m3fn_bits,
    e4m3fn_reference,
    fp8_ds_mla_entry_bytes,
    fp8_ds_mla_insert_reference,
    mxfp4_prologue_reference,
)

import warmreg
from warmreg.testing import OpCall, assert_matches, check_out

# -- the e4m3fn encoder ------------------------------------------------------------------------------------------


@triton.jit
def _e4m3fn_probe_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, e4m3fn_bits(tl.load(x_ptr + offs)))


@attrs.frozen(kw_only=True)
class _ProbeKey(warmreg.CompileKey):
    n: int


class _Probe(warmreg.TritonKernel[_ProbeKey]):
    key_type = _ProbeKey
    jit = _e4m3fn_probe_kernel

    @warmreg.kernel_launcher
    def __call__(self, x: torch.Tensor) -> warmreg.LaunchSpec[_ProbeKey]:
        key = _ProbeKey(n=x.numel())
        out = torch.empty(x.numel(), dtype=torch.uint8)
        return warmreg.LaunchSpec(key, (1,), dict(x_ptr=x, out_ptr=out, N=key.n), out)


def test_e4m3fn_bits_are_torchs() -> None:
    """Ties to even (normal and subnormal), the subnormal range, the normal boundary, saturation past 448 and of
    infinities, signed zeros, NaN: the bytes torch's cast gives after the ``satfinite`` clamp."""
    special = [0.0, -0.0, 1.0625, 1.1875, 7.97, 3 * 2.0**-10, 2.0**-10, 2.0**-7 * 1.5, 2.0**-6, 2.0**-6 * 0.9999,
               464.0, 448.0, 480.0, -1e9, float("inf"), -float("inf"), 2.0**-12, 1e-30]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.tensor(special), torch.randn(110, generator=gen) * torch.logspace(-4, 2.7, 110)])
    got = _Probe()(x)
    assert torch.equal(got, e4m3fn_reference(x))
    assert _Probe()(torch.tensor([float("nan")] * 2 + [0.0] * 126))[:2].tolist() == [0x7F, 0x7F]


# -- the prologue --------------------------------------------------------------------------------------------------

Q, KV, R, D, TOPK = 1536, 512, 64, 128, 2048


def _store(blocks: int, mla_bs: int, index_bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One packed cache storage: per block row, the MLA page then the indexer page (strided page views)."""
    mla_page, index_page = mla_bs * fp8_ds_mla_entry_bytes(KV, R), index_bs * entry_bytes(D)
    row = mla_page + index_page + 64
    storage = torch.zeros(blocks * row, dtype=torch.uint8)
    mla = storage.as_strided((blocks, mla_bs, fp8_ds_mla_entry_bytes(KV, R)), (row, fp8_ds_mla_entry_bytes(KV, R), 1))
    index = storage.as_strided((blocks, index_bs, entry_bytes(D)), (row, entry_bytes(D), 1), mla_page)
    return storage, mla, index


def _inputs(tokens: int, mla_slots: list[int], index_slots: list[int], *, seed: int = 0) -> dict[str, Any]:
    """The fused forward's arguments: column views of one packed bf16 projection output, an fp8_ds_mla and an
    MXFP4 indexer page per block row, int64 slots."""
    gen = torch.Generator().manual_seed(seed)
    proj = (torch.randn(tokens, Q + KV + R + D + 32, generator=gen) * 2).to(torch.bfloat16)
    q_c, kv_c, k_pe, index_k, _ = proj.split([Q, KV, R, D, 32], dim=-1)
    _, mla, index = _store(3, 16, 16)
    return {
        "q_c": q_c, "kv_c": kv_c, "k_pe": k_pe, "index_k": index_k,
        "q_norm_weight": (torch.rand(Q, generator=gen) + 0.5).to(torch.bfloat16),
        "kv_norm_weight": (torch.rand(KV, generator=gen) + 0.5).to(torch.bfloat16),
        "k_norm_weight": torch.rand(D, generator=gen) + 0.5, "k_norm_bias": torch.randn(D, generator=gen) * 0.1,
        "eps": 1e-5, "topk_indices_buffer": torch.randint(0, 99, (tokens + 2, TOPK), generator=gen, dtype=torch.int32),
        "mla_cache": mla, "mla_slot_mapping": torch.tensor(mla_slots), "index_cache": index,
        "index_slot_mapping": torch.tensor(index_slots),
    }  # fmt: skip


def _copies(inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs with the cache storage and the top-k buffer copied (the caches as views of the copy)."""
    out = dict(inputs, topk_indices_buffer=inputs["topk_indices_buffer"].clone())
    mla = inputs["mla_cache"]
    if mla is not None:
        storage = mla.as_strided((mla.untyped_storage().nbytes(),), (1,), 0).clone()
        for name in ("mla_cache", "index_cache"):
            c = inputs[name]
            out[name] = storage.as_strided(c.shape, c.stride(), c.storage_offset())
    return out


def _storage(cache: torch.Tensor) -> torch.Tensor:
    return cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)


def _check(inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch and compare with the references (the module docstring's tolerances); returns the outputs."""
    theirs, mla_only = _copies(inputs), _copies(inputs)
    q_out, kv_out = MXFP4Prologue()(**inputs, launch_pdl=False)
    want = mxfp4_prologue_reference(**theirs)
    assert_matches((q_out, kv_out), want)  # bf16: one rounding step
    assert torch.equal(inputs["topk_indices_buffer"], theirs["topk_indices_buffer"])
    t = inputs["q_c"].shape[0]
    assert inputs["topk_indices_buffer"][:t].eq(-1).all() and inputs["topk_indices_buffer"][t:].ne(-1).all()
    if inputs["mla_cache"] is None:
        return q_out, kv_out
    # fp8_ds_mla from the kernel's own kv_out, then the MXFP4 key entries: exactly this storage, up to the nibbles
    fp8_ds_mla_insert_reference(kv_out, inputs["k_pe"], inputs["mla_slot_mapping"], mla_only["mla_cache"])
    mxfp4_key_insert_reference(
        inputs["index_k"], inputs["k_norm_weight"], inputs["k_norm_bias"], inputs["eps"],
        inputs["index_slot_mapping"], mla_only["index_cache"], mla_only["topk_indices_buffer"], t,
    )  # fmt: skip
    got, want_bytes = _storage(inputs["mla_cache"]), _storage(mla_only["mla_cache"])
    differ = got != want_bytes
    assert int(differ.sum()) <= 2, "only a few packed MXFP4 key bytes may differ"
    if differ.any():  # a packed byte of a key entry, one code apart
        g, w = got[differ].int(), want_bytes[differ].int()
        assert int(((g & 7) - (w & 7)).abs().max()) <= 1 and int(((g >> 4 & 7) - (w >> 4 & 7)).abs().max()) <= 1
    return q_out, kv_out


def test_matches_reference() -> None:
    """Five tokens, the last two padding rows past both slot mappings, one token without an MLA slot."""
    inputs = _inputs(5, [1, 17, -1], [0, 33, 20], seed=1)
    _check(inputs)
    mla = inputs["mla_cache"]
    assert mla[0, 1].any() and mla[1, 1].any() and not mla[2].any()  # slots 1 and 17 only
    assert inputs["index_cache"][0, 0].any() and inputs["index_cache"][2, 1].any()


def test_small_widths_and_one_token() -> None:
    """The widths are constexprs: a q_lora of 96 (tile 128), a 128 latent, 16 RoPE values, a 32-wide key, top-k
    100 (fill tile 128); one token, the MLA cache entries 4-byte padded (stride 176 for 164 bytes)."""
    gen = torch.Generator().manual_seed(3)
    proj = (torch.randn(1, 96 + 128 + 16 + 32, generator=gen) * 3).to(torch.bfloat16)
    q_c, kv_c, k_pe, index_k = proj.split([96, 128, 16, 32], dim=-1)
    mla = torch.zeros(2, 4, 176, dtype=torch.uint8)[..., :164]
    inputs = {
        "q_c": q_c, "kv_c": kv_c, "k_pe": k_pe, "index_k": index_k,
        "q_norm_weight": torch.rand(96, generator=gen).to(torch.bfloat16) + 0.5,
        "kv_norm_weight": torch.rand(128, generator=gen).to(torch.bfloat16) + 0.5,
        "k_norm_weight": torch.ones(32), "k_norm_bias": torch.zeros(32), "eps": 1e-6,
        "topk_indices_buffer": torch.zeros(1, 100, dtype=torch.int32), "mla_cache": mla,
        "mla_slot_mapping": torch.tensor([6]), "index_cache": torch.zeros(2, 4, entry_bytes(32), dtype=torch.uint8),
        "index_slot_mapping": torch.tensor([5], dtype=torch.int32),
    }  # fmt: skip
    theirs = {**inputs, "mla_cache": torch.zeros(2, 4, 176, dtype=torch.uint8)[..., :164],
              "index_cache": torch.zeros(2, 4, entry_bytes(32), dtype=torch.uint8),
              "topk_indices_buffer": torch.zeros(1, 100, dtype=torch.int32)}  # fmt: skip
    q_out, kv_out = MXFP4Prologue()(**inputs, launch_pdl=False)
    assert_matches((q_out, kv_out), mxfp4_prologue_reference(**theirs))
    fp8_ds_mla_insert_reference(kv_out, k_pe, inputs["mla_slot_mapping"], theirs["mla_cache"])
    assert torch.equal(mla, theirs["mla_cache"]) and mla[1, 2].any()  # slot 6: block 1, entry 2
    assert inputs["topk_indices_buffer"].eq(-1).all()
    assert torch.equal(inputs["index_cache"][1, 1], theirs["index_cache"][1, 1])  # slot 5: exact sums of 32


def test_profile_run_without_caches() -> None:
    """``None`` caches (vLLM's profile run): the norms and the top-k fill only, the key of a real step."""
    inputs = _inputs(3, [0, 1, 2], [0, 1, 2], seed=2)
    kernel = MXFP4Prologue()
    profile = {**inputs, "mla_cache": None, "mla_slot_mapping": None, "index_cache": None, "index_slot_mapping": None}
    _check(profile)

    def key(args: dict[str, Any]) -> warmreg.CompileKey:
        names = kernel.dispatch_params()
        return kernel.dispatch(**{n: args[n] for n in names if n != "launch_pdl"}, launch_pdl=False)

    assert key(profile) == key(inputs)


def test_layouts_share_one_binary() -> None:
    """Contiguous activations and column views, int32 slots: the same outputs' references and one key."""
    kernel, keys = MXFP4Prologue(), set()
    base = _inputs(3, [4, 5, 40], [40, 2, 3], seed=5)
    contiguous = {n: base[n].contiguous() for n in ("q_c", "kv_c", "k_pe", "index_k")}
    for inputs in (base, {**base, **contiguous}):
        inputs = {**inputs, **_copies(inputs)}
        _check(inputs)
        keys.add(kernel.dispatch(**{n: inputs[n] for n in kernel.dispatch_params() if n != "launch_pdl"},
                                 launch_pdl=False))  # fmt: skip
    assert len(keys) == 1
    int32 = {**base, "mla_slot_mapping": base["mla_slot_mapping"].int()}
    names = [n for n in kernel.dispatch_params() if n != "launch_pdl"]
    assert kernel.dispatch(**{n: int32[n] for n in names}, launch_pdl=False).fields()["mla_slot_dtype"] == "int32"


def test_empty_batch_and_launch_errors() -> None:
    kernel, inputs = MXFP4Prologue(), _inputs(2, [0, 1], [0, 1])
    empty = {**inputs, **{n: inputs[n][:0] for n in ("q_c", "kv_c", "k_pe", "index_k")}}
    q_out, kv_out = kernel(**empty, launch_pdl=False)
    assert q_out.shape == (0, Q) and kv_out.shape == (0, KV) and not inputs["mla_cache"].any()
    bad = [
        ("kv_c", inputs["kv_c"][:, :384], "power of two of whole 128"),
        ("k_pe", inputs["k_pe"][:1], "k_pe must be"),
        ("q_c", inputs["q_c"].float(), "q_c must be"),
        ("index_k", inputs["index_k"][:, :96], "power of two"),
        ("mla_cache", torch.zeros(3, 16, 640, dtype=torch.uint8), "mla_cache must be uint8"),
        ("mla_cache", torch.zeros(3 * 16 * 656 + 2, dtype=torch.uint8)[2:].view(3, 16, 656), "4-byte aligned"),
        ("index_cache", torch.zeros(3, 16, 132, dtype=torch.uint8), "index_cache must be uint8"),
        ("index_slot_mapping", inputs["index_slot_mapping"].float(), "index_slot_mapping"),
        ("topk_indices_buffer", inputs["topk_indices_buffer"][:1], "topk_indices_buffer"),
        ("k_norm_bias", inputs["k_norm_bias"][:64], "norm_bias"),
        ("q_norm_weight", inputs["q_norm_weight"][:100], "q_norm_weight"),
    ]
    for arg, value, match in bad:
        with pytest.raises(warmreg.LaunchError, match=match):
            kernel(**{**inputs, arg: value}, launch_pdl=False)


def test_out() -> None:
    def build() -> OpCall:
        inputs = _inputs(2, [0, 3], [1, 2], seed=4)
        return OpCall(MXFP4Prologue(), tuple(inputs.values()), {"launch_pdl": False})

    check_out(build)
