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
