"""warmreg's test kit (warmreg.testing) catches what it is for: an op that ignores, half-writes or does not check
its out= buffers, allocates with them, or differs from its reference; and its planning helpers."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import triton
import triton.language as tl

import warmreg
from warmreg.testing import (
    OpCall,
    RegisterPlugin,
    assert_allocates_nothing,
    assert_matches,
    assert_out_refused,
    assert_out_written,
    assert_warmup_inputs_reproduce,
    check_out,
    config_loader,
    garbage_like,
)  # fmt: skip


@triton.jit
def _double_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)


@attrs.frozen
class DoubleKey(warmreg.CompileKey):
    dtype: str


class Double(warmreg.TritonKernel[DoubleKey]):
    """out = 2 * x; the subclasses below each break one part of the out= contract."""

    jit = _double_kernel

    def dispatch(self, *, x: torch.Tensor) -> DoubleKey:
        return DoubleKey(warmreg.dtype_name(x.dtype))

    def domains(self, config: Any, platform: Any) -> dict[str, Any]:
        return {"x": [warmreg.meta((n,), torch.float32) for n in (1, 16)]}

    def buffer(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return warmreg.output(self.name, "out", out, tuple(x.shape), x.dtype, x.device)

    @warmreg.kernel_launcher
    def __call__(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> warmreg.LaunchSpec[DoubleKey]:
        out, n = self.buffer(x, out), x.numel()
        return warmreg.LaunchSpec(self.dispatch(x=x), (triton.cdiv(n, 64),), dict(x_ptr=x, out_ptr=out, n=n, BLOCK=64), out)


class IgnoresOut(Double):
    def buffer(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty(x.shape)


class ChecksNothing(Double):
    def buffer(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty(x.shape) if out is None else out


def _call(kernel: Double) -> OpCall:
    return OpCall(kernel, (torch.arange(70, dtype=torch.float32),))


def test_a_conforming_op_passes() -> None:
    check_out(lambda: _call(Double()))


def test_an_op_that_ignores_out_fails_every_part() -> None:
    with pytest.raises(AssertionError, match="out is not returned"):
        assert_out_written(lambda: _call(IgnoresOut()))
    with pytest.raises(AssertionError, match="allocated with out given"):
        assert_allocates_nothing(_call(IgnoresOut()))


def test_an_op_that_checks_nothing_is_refused() -> None:
    with pytest.raises(AssertionError, match="out of another dtype was accepted"):
        assert_out_refused(lambda: _call(ChecksNothing()))
    assert_out_refused(lambda: _call(ChecksNothing()), accepts={"another dtype", "another shape", "another device", "strided", "misaligned"})


def test_a_half_written_out_is_caught() -> None:
    class Half(Double):
        @warmreg.kernel_launcher
        def __call__(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> warmreg.LaunchSpec[DoubleKey]:
            spec = Double.__call__.__wrapped__(self, x, out=out)  # type: ignore[attr-defined]
            return warmreg.LaunchSpec(spec.key, spec.grid, {**spec.kwargs, "n": x.numel() // 2}, spec.outputs)

    with pytest.raises(AssertionError, match="not equal"):
        assert_out_written(lambda: _call(Half()))


def test_garbage_and_matches() -> None:
    assert garbage_like(torch.zeros(2, dtype=torch.float8_e4m3fn)).view(torch.uint8).tolist() == [0x7F, 0x7F]
    assert garbage_like(torch.zeros(2, dtype=torch.int32)).tolist() == [7777, 7777]
    assert_matches((torch.ones(2, dtype=torch.bfloat16), None), (torch.ones(2, dtype=torch.bfloat16) * 1.004, None))
    with pytest.raises(AssertionError, match=r"output \[1\]"):
        assert_matches((torch.ones(2), torch.tensor([1, 2])), (torch.ones(2), torch.tensor([1, 3])))
    with pytest.raises(AssertionError):  # FP8: the codes, exactly
        fp8 = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
        assert_matches(fp8, torch.tensor([1.0, 2.25]).to(torch.float8_e4m3fn), {"rtol": 1.0, "atol": 1.0})
    mask = torch.tensor([True, False])
    assert_matches(torch.tensor([1.0, 5.0]), torch.tensor([1.0, float("nan")]), masks=(mask,))


def test_planning_helpers(tmp_path: Path) -> None:
    (tmp_path / "m.json").write_text('{"model": {"model_type": "m"}, "serving": {"max_num_batched_tokens": 8}}')
    config = config_loader(tmp_path)("m", max_num_batched_tokens=64)
    assert config["serving"]["max_num_batched_tokens"] == 64
    seen = []
    plugin = RegisterPlugin(lambda registry, model, cfg, platform: (seen.append(model), registry.add(Double())), model=lambda c: c.model_type)
    plan = warmreg.plan(config, target="cuda:90", plugins=[plugin], entry_points=False)
    assert seen == ["m"] and len(plan.kernels[0].keys) == 1
    kp = plan.kernels[0]
    assert_warmup_inputs_reproduce(kp.kernel_for(kp.keys[0]), kp.keys)
    with pytest.raises(warmreg.KernelContractError, match="no domain point"):
        assert_warmup_inputs_reproduce(kp.kernel, [DoubleKey("float16")])  # no point gave it: the default raises

    class Wrong(Double):
        def warmup_inputs(self, key: DoubleKey) -> dict[str, Any]:
            return {"x": warmreg.meta((4,), torch.float16)}

    with pytest.raises(AssertionError, match="dispatch to"):
        assert_warmup_inputs_reproduce(Wrong(), kp.keys)


def test_materialize_keeps_the_meta_layout_and_rebuilds_containers() -> None:
    from warmreg.testing import materialize

    view = warmreg.meta((3, 4), torch.bfloat16, stride=(10, 1), offset=5)  # a view of a fused row: the key's misalignment
    real = materialize(view)
    assert (real.shape, real.stride(), real.storage_offset(), real.dtype) == ((3, 4), (10, 1), 5, torch.bfloat16)
    assert real.device.type == "cpu" and not real.any()
    assert real.untyped_storage().nbytes() == view.untyped_storage().nbytes()  # the same extent: views stay in bounds

    Pair = collections.namedtuple("Pair", "a b")

    @attrs.frozen
    class Table:
        rows: torch.Tensor
        count: int

    out = materialize([Pair(view, 7), (view,), Table(view, 3), "kept"])
    assert isinstance(out[0], Pair) and out[0].b == 7 and out[0].a.device.type == "cpu"
    assert isinstance(out[1], tuple) and out[1][0].device.type == "cpu"
    assert isinstance(out[2], Table) and out[2].rows.device.type == "cpu" and out[2].count == 3
    assert out[3] == "kept"
    assert materialize(torch.ones(2)).device.type == "cpu"  # a real tensor is left as it is
