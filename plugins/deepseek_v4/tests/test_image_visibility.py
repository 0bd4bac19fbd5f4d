"""In-image visibility of a vision checkpoint's prefill tokens: exact equality with the PyTorch reference under
Triton's interpreter, the math on hand-picked spans, views, errors, the plan (a vision config built here: no example
is one), out=, and a real cross-compile."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from warmreg_deepseek_v4 import image_visibility
from warmreg_deepseek_v4.image_visibility import ImageVisibility, image_visibility_reference
from warmreg_deepseek_v4.model import DSV4

import warmreg
from warmreg.testing import OpCall, RegisterPlugin, assert_warmup_inputs_reproduce, check_out, config_loader

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
example_config = config_loader(EXAMPLES)
NAME = ImageVisibility.name
I32 = torch.int32


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=I32)


def _batch(
    seed: int, *, decodes: int, prefills: int, max_image_tokens: int
) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """A decode-first step: one-token decodes, then prefill chunks of 1-24 tokens over contexts with 0-3 image spans
    each (inclusive ``[start, end]``, at most ``max_image_tokens`` long, some overlapping the chunk's edges).

    :returns: the op's six tensors, ``num_tokens`` (the prefill tokens) and ``token_offset`` (the decode tokens).
    """
    rng = random.Random(seed)
    qlens = [1] * decodes + [rng.randint(1, 24) for _ in range(prefills)]
    seqs = [q + rng.randint(0, 40) for q in qlens]
    indptr, starts, ends = [0], [], []
    for r, s in enumerate(seqs):
        for _ in range(rng.randint(0, 3) if r >= decodes else 0):
            start = rng.randint(0, s - 1)
            starts.append(start)
            ends.append(min(start + rng.randint(0, max_image_tokens - 1), s + 5))
        indptr.append(len(starts))
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    reqs = [r for r, q in enumerate(qlens) for _ in range(q)]
    tensors = (_i32(indptr), _i32(starts), _i32(ends), _i32(qsl), _i32(seqs), _i32(reqs))
    return tensors, len(reqs) - decodes, decodes


def test_counts_inside_a_span() -> None:
    """One prefill of positions 10..19 over spans [12, 15] and [17, 30]; M = 3 clamps the counts."""
    args = (_i32([0, 2]), _i32([12, 17]), _i32([15, 30]), _i32([0, 10]), _i32([20]), _i32([0] * 10))
    left, right = ImageVisibility()(*args, num_tokens=10, max_image_tokens=3)
    #        pos: 10 11 12 13 14 15 16 17 18 19
    assert left.tolist() == [0, 0, 0, 1, 2, 2, 0, 0, 1, 2]  # min(pos - start, M - 1)
    assert right.tolist() == [0, 0, 3, 2, 1, 0, 0, 3, 3, 3]  # min(end - pos, M)


def test_the_last_span_holding_a_token_wins() -> None:
    """Overlapping spans [0, 9] then [4, 5]: positions 4 and 5 take the second's counts."""
    args = (_i32([0, 2]), _i32([0, 4]), _i32([9, 5]), _i32([0, 8]), _i32([8]), _i32([0] * 8))
    left, right = ImageVisibility()(*args, num_tokens=8, max_image_tokens=100)
    assert left.tolist() == [0, 1, 2, 3, 0, 1, 6, 7]
    assert right.tolist() == [9, 8, 7, 6, 1, 0, 3, 2]


@pytest.mark.parametrize(("decodes", "prefills", "m"), [(0, 1, 8), (3, 4, 5), (2, 7, 1024)])
def test_matches_reference(decodes: int, prefills: int, m: int) -> None:
    tensors, tokens, offset = _batch(decodes * 10 + prefills, decodes=decodes, prefills=prefills, max_image_tokens=m)
    left, right = ImageVisibility()(*tensors, num_tokens=tokens, max_image_tokens=m, token_offset=offset)
    want = image_visibility_reference(*tensors, num_tokens=tokens, max_image_tokens=m, token_offset=offset)
    assert left.shape == right.shape == (offset + tokens,)
    assert torch.equal(left[offset:], want[0]) and torch.equal(right[offset:], want[1])


def test_persistent_buffers_and_offset_views() -> None:
    """vLLM's buffers: the builder's ``[max_tokens]`` side buffers, of which the op writes rows [offset, end) of
    the prefix; rows before (the decode tokens) and past keep what they held. Offset views of the inputs too."""
    tensors, tokens, offset = _batch(5, decodes=3, prefills=3, max_image_tokens=6)
    left_buf, right_buf = torch.full((64,), 7777, dtype=I32), torch.full((64,), 7777, dtype=I32)
    end = offset + tokens
    padded = tuple(torch.cat([_i32([-5]), t])[1:] for t in tensors)  # offset views, same values
    got = ImageVisibility()(
        *padded, num_tokens=tokens, max_image_tokens=6, token_offset=offset, out=(left_buf[:end], right_buf[:end])
    )
    want = image_visibility_reference(*tensors, num_tokens=tokens, max_image_tokens=6, token_offset=offset)
    assert got[0].data_ptr() == left_buf.data_ptr() and got[1].data_ptr() == right_buf.data_ptr()
    assert torch.equal(left_buf[offset:end], want[0]) and torch.equal(right_buf[offset:end], want[1])
    for buf in (left_buf, right_buf):
        assert (buf[:offset] == 7777).all() and (buf[end:] == 7777).all()


def test_empty_step_and_launch_errors() -> None:
    kernel = ImageVisibility()
    tensors, tokens, offset = _batch(1, decodes=2, prefills=2, max_image_tokens=4)
    left, right = kernel(*tensors, num_tokens=0, max_image_tokens=4, token_offset=offset)
    assert left.shape == right.shape == (offset,)
    kw: dict[str, Any] = {"num_tokens": tokens, "max_image_tokens": 4, "token_offset": offset}
    with pytest.raises(warmreg.LaunchError, match="span_starts must be a contiguous 1-D int32"):
        kernel(tensors[0], tensors[1].long(), *tensors[2:], **kw)
    with pytest.raises(warmreg.LaunchError, match="token_to_req"):
        kernel(*tensors, **{**kw, "num_tokens": tokens + 1})
    with pytest.raises(warmreg.LaunchError, match="max_image_tokens"):
        kernel(*tensors, **{**kw, "max_image_tokens": 0})


# -- the plan ---------------------------------------------------------------------------------------------------
def _vision(name: str = "deepseek_v4_flash", *, layers: int = 24, tokens: int = 1024) -> dict[str, Any]:
    """An example turned into a vision checkpoint's config (DeepSeek-V4-Flash-Vision-Exp's two fields)."""
    config = example_config(name)
    config["model"].update(vision_n_layers=layers, vision_max_n_token=tokens)
    return config


@pytest.mark.parametrize("target", ["cuda:90", "cuda:100", "rocm:gfx942", "xpu:pvc"])
def test_one_key_for_a_vision_checkpoint_on_every_platform(target: str) -> None:
    (key,) = warmreg.plan(_vision(), target=target).kernel(NAME).keys
    assert key.fields() == {"num_warps": 4}
    assert_warmup_inputs_reproduce(warmreg.plan(_vision(), target=target).kernel(NAME).kernel, [key])


@pytest.mark.parametrize("example", ["deepseek_v4_flash", "deepseek_v4_pro", "deepseek_v4_flash_0731_dspark"])
def test_not_planned_for_text_checkpoints(example: str) -> None:
    assert NAME not in {k.name for k in warmreg.plan(EXAMPLES / f"{example}.json", target="cuda:90").kernels}


def test_a_vision_checkpoint_needs_both_fields() -> None:
    """vLLM's rule: ``vision_max_n_token`` counts only with a vision tower (``vision_n_layers > 0``), and a tower
    with ``vision_max_n_token`` 0 widens nothing."""
    for config in (_vision(layers=0), _vision(tokens=0)):
        assert NAME not in {k.name for k in warmreg.plan(config, target="cuda:90").kernels}


def test_warm_cross_compiles_for_cuda_and_gfx942() -> None:
    plugin = RegisterPlugin(image_visibility.register, model=DSV4.from_config)
    for target in ("cuda:90", "rocm:gfx942"):
        report = warmreg.warm(_vision(), target=target, plugins=[plugin], entry_points=False)
        assert report.ok and report.compiled == 1, [(r.kernel, r.error) for r in report.failed]


# -- out= (the kit's check_out: returned and written where the op writes, wrong buffers refused, nothing allocated)
def test_out() -> None:
    tensors, tokens, offset = _batch(9, decodes=2, prefills=3, max_image_tokens=6)
    written = torch.arange(offset + tokens) >= offset

    def build() -> OpCall:
        kw = {"num_tokens": tokens, "max_image_tokens": 6, "token_offset": offset}
        return OpCall(ImageVisibility(), tuple(t.clone() for t in tensors), kw, masks=(written, written))

    check_out(build)
