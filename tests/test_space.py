"""The warmup space is the image of dispatch over the domains, filtered by when()."""

from __future__ import annotations

from typing import Any

import pytest

import warmreg
from tests.helpers import CONFIG, Plugin, Scale, ScaleKey, TunedDouble, TunedKey


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


class Witnessed(Scale):
    """:class:`Scale` with the default ``warmup_inputs``: each key's domain point, ``scale`` among the domains."""

    name = "tests.witnessed_scale"
    warmup_inputs = warmreg.TritonKernel.warmup_inputs  # type: ignore[assignment]

    def domains(self, config: Any, platform: Any) -> dict[str, Any]:
        return {**super().domains(config, platform), "scale": [0.5]}


def test_default_warmup_inputs_are_the_last_domain_point_of_each_key() -> None:
    import torch

    kernel = Witnessed(sizes=(16, 1, 32, 17))
    plan = warmreg.plan(CONFIG, target="cuda:90", plugins=[Plugin(kernel)], entry_points=False)
    keys = {k.n_class: k for k in plan.kernel(Witnessed.name).keys}
    inputs = kernel.warmup_inputs(keys["div16"])
    assert set(inputs) == {"x", "scale", "block"}  # only_for_when is no parameter of the launcher: left out
    assert inputs["x"].shape == (32,) and inputs["x"].device.type == "meta" and inputs["scale"] == 0.5  # the last of 16, 32
    assert kernel.dispatch(x=inputs["x"], block=inputs["block"]) == keys["div16"]
    assert kernel.warmup_inputs(keys["one"])["x"].dtype == torch.float16
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(kernel)], entry_points=False, workers=1)
    assert report.ok and report.compiled == 3  # each key's launch code ran on its point and gave back its key


def test_default_warmup_inputs_need_a_plan_of_the_instance() -> None:
    plan = warmreg.plan(CONFIG, target="cuda:90", plugins=[Plugin(Witnessed())], entry_points=False)
    key = plan.kernels[0].keys[0]
    with pytest.raises(warmreg.KernelContractError, match="override warmup_inputs"):
        Witnessed().warmup_inputs(key)  # another instance, never enumerated
    assert Scale().warmup_inputs(key)["scale"] == 2.0  # an explicit warmup_inputs still overrides the default


def test_default_warmup_inputs_of_a_tuned_kernel_are_those_of_its_tuning_key() -> None:
    class Tuned(TunedDouble):
        name = "tests.witnessed_tuned"
        warmup_inputs = warmreg.TritonKernel.warmup_inputs  # type: ignore[assignment]

    kernel = Tuned()
    plan = warmreg.plan(CONFIG, target="cuda:90", plugins=[Plugin(kernel)], entry_points=False)
    assert [k.config for k in plan.kernels[0].keys] == [0, 1]
    for key in plan.kernels[0].keys:
        assert kernel.warmup_inputs(key)["x"].shape == (100,)
    report = warmreg.warm(CONFIG, target="cuda:90", plugins=[Plugin(kernel)], entry_points=False, workers=1)
    assert report.ok and report.compiled == 2


def test_key_type_defaults_to_the_generic_argument() -> None:
    class Inferred(warmreg.TritonKernel[ScaleKey]):
        """No key_type: the generic argument's."""

    class Explicit(warmreg.TritonKernel[ScaleKey]):
        key_type = TunedKey

    class Inherited(Explicit):
        """No key_type of its own: the parent's."""

    assert Inferred.key_type is ScaleKey and Explicit.key_type is TunedKey and Inherited.key_type is TunedKey
