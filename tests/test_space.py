"""The warmup space is the image of dispatch over the domains, filtered by when()."""

from __future__ import annotations

from typing import Any

import pytest

import warmreg
from tests.helpers import CONFIG, Plugin, Scale, ScaleKey


def test_keys_are_the_deduplicated_image_of_dispatch() -> None:
    plan = warmreg.plan(CONFIG, target="cuda:90", plugins=[Plugin(Scale(sizes=(1, 16, 32, 17, 33)))], entry_points=False)
    keys = plan.kernel("tests.scale").keys
    # 5 sizes fall in 3 integer classes -> 3 keys, sorted, no duplicates
    assert [k.n_class for k in keys] == ["div16", "one", "other"]
    assert all(isinstance(k, ScaleKey) for k in keys)


def test_predicate_only_inputs_never_reach_the_key() -> None:
    seen: list[dict[str, Any]] = []

    class Spy(Scale):
        def dispatch(self, *, x: Any, block: int) -> ScaleKey:  # the signature declares what dispatch reads
            seen.append({"x": x, "block": block})
            return super().dispatch(x=x, block=block)

    plan = warmreg.plan(CONFIG, target="cuda:90", plugins=[Plugin(Spy(sizes=(16,)))], entry_points=False)
    assert len(seen) == 1  # only_for_when=1 was filtered by when(), only_for_when=0 kept
    assert all(set(call) == {"x", "block"} for call in seen)
    assert "only_for_when" not in plan.kernels[0].keys[0].fields()


def test_two_registrations_of_one_kernel_merge_by_name() -> None:
    plan = warmreg.plan(
        CONFIG, target="cuda:90", plugins=[Plugin(Scale(sizes=(16,))), Plugin(Scale(sizes=(16, 17)))], entry_points=False
    )
    assert len(plan.kernels) == 1 and len(plan.kernel("tests.scale").keys) == 2


def test_predicates_are_evaluated_by_the_core() -> None:
    plugin = Plugin((Scale(), warmreg.is_rocm))
    assert warmreg.plan(CONFIG, target="cuda:90", plugins=[plugin], entry_points=False).kernels == ()
    skipped = warmreg.plan(CONFIG, target="cuda:90", plugins=[plugin], entry_points=False).skipped
    assert skipped[0].reason.startswith("is_rocm is false on cuda:90")
    assert len(warmreg.plan(CONFIG, target="rocm:gfx942", plugins=[plugin], entry_points=False).kernels) == 1


def test_dispatch_needing_an_undeclared_input_is_a_contract_error() -> None:
    class NoDomain(Scale):
        def domains(self, config: Any, platform: Any) -> dict[str, Any]:
            return {"x": [warmreg.meta((16,), __import__("torch").float16)]}

    with pytest.raises(warmreg.KernelContractError, match="block"):
        warmreg.plan(CONFIG, target="cuda:90", plugins=[Plugin(NoDomain())], entry_points=False)


def test_conflicting_kernel_classes_under_one_name() -> None:
    class Other(Scale):
        pass

    Other.name = "tests.scale"
    with pytest.raises(warmreg.PluginError, match=r"tests\.scale"):
        warmreg.plan(CONFIG, target="cuda:90", plugins=[Plugin(Scale(), Other())], entry_points=False)


def test_plan_json_round_trips_keys() -> None:
    plan = warmreg.plan(CONFIG, target="cuda:90", plugins=[Plugin(Scale())], entry_points=False)
    data = plan.to_json()
    assert data["num_keys"] == 3
    keys = [warmreg.CompileKey.from_json(k) for k in data["kernels"][0]["keys"]]
    assert tuple(keys) == plan.kernel("tests.scale").keys


def test_declared_keys_are_validated_at_plan_time() -> None:
    import torch

    class BadValue(Scale):
        def dispatch(self, *, x: Any, block: int) -> ScaleKey:
            return ScaleKey(dtype=x.dtype, block=block, n_class="div16", aligned=True, num_warps=2)  # a torch.dtype

    with pytest.raises(warmreg.CompileKeyError, match=r"ScaleKey\.dtype"):
        warmreg.plan(CONFIG, target="cuda:90", plugins=[Plugin(BadValue(sizes=(16,)))], entry_points=False)
    assert torch  # the dtype object above is what the key must not hold


def test_domains_may_list_points_of_inputs_that_vary_together() -> None:
    import torch

    class Points(Scale):
        def domains(self, config: Any, platform: Any) -> list[dict[str, Any]]:
            return [{"x": warmreg.meta((n,), torch.float16), "block": 64, "only_for_when": 0} for n in (1, 16, 32)]

    plan = warmreg.plan(CONFIG, target="cuda:90", plugins=[Plugin(Points())], entry_points=False)
    assert [k.n_class for k in plan.kernels[0].keys] == ["div16", "one"]

    class Lacking(Scale):
        def domains(self, config: Any, platform: Any) -> list[dict[str, Any]]:
            return [{"x": warmreg.meta((1,), torch.float16)}]

    with pytest.raises(warmreg.KernelContractError, match="lacks"):
        warmreg.plan(CONFIG, target="cuda:90", plugins=[Plugin(Lacking())], entry_points=False)
