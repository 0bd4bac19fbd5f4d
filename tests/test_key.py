from __future__ import annotations

import json

import attrs
import pytest

import warmreg
from warmreg.values.key import int_class, int_class_rep


@attrs.frozen(kw_only=True)
class K(warmreg.CompileKey):
    block: int
    dtype: str
    widths: tuple[int, ...] = ()
    num_warps: int = 4
    launch_pdl: bool = False


def test_json_round_trip_through_text() -> None:
    key = K(block=1024, dtype="bfloat16", widths=(128, 256))
    text = json.dumps(key.to_json())
    back = warmreg.CompileKey.from_json(json.loads(text))
    assert back == key and hash(back) == hash(key) and isinstance(back, K)


def test_diff_names_each_differing_field() -> None:
    a, b = K(block=1024, dtype="bfloat16"), K(block=2048, dtype="bfloat16", num_warps=8)
    diff = a.diff(b)
    assert [d.field for d in diff] == ["block", "num_warps"]
    assert str(diff[0]) == "block: 1024 != 2048"
    assert a.diff(a) == ()


def test_order_is_numeric_not_lexicographic() -> None:
    keys = [K(block=1024, dtype="x"), K(block=128, dtype="x"), K(block=16, dtype="x")]
    assert [k.block for k in sorted(keys)] == [16, 128, 1024]


def test_launch_options_come_from_named_fields() -> None:
    assert K(block=1, dtype="x", num_warps=8).launch_options() == {"num_warps": 8}
    assert K(block=1, dtype="x", launch_pdl=True).launch_options() == {"num_warps": 4, "launch_pdl": True}


def test_non_json_value_is_refused_with_the_field_name() -> None:
    import torch

    with pytest.raises(warmreg.CompileKeyError, match=r"K\.dtype"):
        K(block=1, dtype=torch.bfloat16).validate()  # type: ignore[arg-type]


def test_unknown_key_type_names_the_fix() -> None:
    with pytest.raises(warmreg.CompileKeyError, match="import"):
        warmreg.CompileKey.from_json({"type": "nowhere:Nothing", "fields": {}})


@pytest.mark.parametrize(
    ("value", "cls"), [(1, "one"), (0, "div16"), (16, "div16"), (4096, "div16"), (17, "other"), (2**31, "div16_i64"), (2**31 + 1, "other_i64")]
)
def test_int_class_matches_triton_specialization(value: int, cls: str) -> None:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    assert int_class(value) == cls
    assert int_class(int_class_rep(cls)) == cls  # type: ignore[arg-type]
    ty, attr = native_specialize_impl(BaseBackend, value, False, True, True)
    expected = {"one": ("constexpr", 1), "div16": ("i32", "D"), "other": ("i32", ""), "div16_i64": ("i64", "D"), "other_i64": ("i64", "")}
    assert (ty, attr) == expected[cls]
