from __future__ import annotations

import pytest

import warmreg
from warmreg import Platform


@pytest.mark.parametrize("text", ["cuda:90", "cuda:100", "cuda:120", "rocm:gfx942", "rocm:gfx950", "cuda:90+cutedsl+flashinfer"])
def test_targets_parse_and_print_back(text: str) -> None:
    assert Platform.parse(text).target == text


@pytest.mark.parametrize("text", ["cuda", "cuda:sm90", "gpu:90", "rocm:942", "", "cuda:90+"])
def test_bad_target_is_one_clear_error(text: str) -> None:
    with pytest.raises(warmreg.TargetError, match="fix:"):
        Platform.parse(text)


def test_platform_facts() -> None:
    h200, b200, mi300, mi355 = (Platform.parse(t) for t in ("cuda:90", "cuda:100", "rocm:gfx942", "rocm:gfx950"))
    assert h200.supports_pdl and b200.supports_pdl and not Platform.parse("cuda:80").supports_pdl
    assert mi300.fp8_fnuz and not mi355.fp8_fnuz and not h200.fp8_fnuz
    assert not mi300.supports_pdl


def test_predicates_combine_and_describe_themselves() -> None:
    pred = warmreg.is_cuda & warmreg.sm_at_least(100) | warmreg.is_fp8_fnuz
    assert pred(Platform.parse("cuda:100")) and pred(Platform.parse("rocm:gfx942"))
    assert not pred(Platform.parse("cuda:90")) and not pred(Platform.parse("rocm:gfx950"))
    assert repr(~warmreg.has_feature("cutedsl")) == "~has(cutedsl)"
    assert (~warmreg.has_feature("cutedsl"))(Platform.parse("cuda:90"))
    assert not (~warmreg.has_feature("cutedsl"))(Platform.parse("cuda:90+cutedsl"))


def test_detect_without_gpu_says_what_to_do() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(warmreg.TargetError, match="cuda:90"):
        Platform.detect()


@pytest.mark.parametrize(("text", "needle"), [
    ("cuda:95", r"sm_95 is no NVIDIA GPU's compute capability; fix: use one of cuda:\{70, .*, 90, .*, 121\}"),
    ("rocm:gfx999", r"gfx999 is no AMD GPU processor; fix: use one of rocm:\{gfx900, .*gfx942, .*gfx1250\}"),
])  # fmt: skip
def test_an_arch_no_gpu_has_is_refused_with_the_known_ones(text: str, needle: str) -> None:
    with pytest.raises(warmreg.TargetError, match=needle):
        Platform.parse(text)


def test_a_feature_no_loaded_plugin_checks_is_refused_with_the_known_ones() -> None:
    from tests.helpers import CONFIG, Plugin, Scale

    plan = warmreg.plan(CONFIG, target="cuda:90+tests_feature", plugins=[Plugin((Scale(), warmreg.has_feature("tests_feature")))],
                        entry_points=False)  # fmt: skip
    assert plan.num_keys == 3
    with pytest.raises(warmreg.TargetError, match=r"names \+cutedls, which no loaded plugin checks; fix: drop it; features .*tests_feature"):
        warmreg.plan(CONFIG, target="cuda:90+cutedls", plugins=[Plugin(Scale())], entry_points=False)


def test_a_failed_compile_leaves_no_files_in_the_cache(monkeypatch: pytest.MonkeyPatch, triton_cache: object) -> None:
    """Triton writes each stage into the entry's directory as it goes; a compile that fails late (here
    LLVM refusing a processor it does not know) must not leave those stages behind."""
    from pathlib import Path

    from tests.helpers import CONFIG, Plugin, Scale
    from warmreg.values import platform

    monkeypatch.setattr(platform, "ROCM_ARCHS", platform.ROCM_ARCHS | {"gfx999"})  # let the target through to Triton
    report = warmreg.warm(CONFIG, target="rocm:gfx999", plugins=[Plugin(Scale())], entry_points=False, on_error="continue")
    assert len(report.failed) == 3
    assert [p for p in Path(str(triton_cache)).rglob("*") if p.is_file()] == []
