"""Shared fixtures: every test gets its own Triton cache directory and no compiled kernels in memory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def triton_cache(warmreg_isolated: Path) -> Path:
    """A fresh, empty Triton cache directory and warmreg's state reset, for each test (warmreg's
    public ``warmreg_isolated`` fixture)."""
    return warmreg_isolated


#: Tests that need what Triton before 3.8 lacks, by node id prefix: its interpreter has no e4m3fnuz (``fp8e4b8``, the
#: gfx942 FP8 the ROCm ops read; the sweeps on gfx942 and the FNUZ cases), keeps no bf16 negative zero, and its AMD
#: backend cannot link gfx1250 code objects. The same tests run on Triton 3.8 and 3.9 (CI's main and newest).
_BEFORE_3_8 = {
    "test_rocm_indexer_logits.py::test_matches_reference[": "fp81",
    "test_rocm_sparse_attn_decode.py::test_partial_matches_reference[": "",
    "test_rocm_sparse_attn_decode.py::test_pipeline_equals_partial_then_reduce": "",
    "test_rocm_sparse_attn_decode_ragged.py::test_decode_matches_reference[": "",
    "test_rocm_sparse_attn_decode_ragged.py::test_warm_cross_compiles_for_gfx1250": "",
    "test_v41_rocm_prefill.py::test_warm_cross_compiles_for_gfx1250": "",
    "test_v41_rocm.py::test_sweep_drives_every_planned_kernel[rocm:gfx942": "",
    "test_v41_rocm_attention.py::test_sweep_launches_the_decode_against_its_references[rocm:gfx942": "",
    "test_v41_rocm_gather_k.py::test_sweep_launches_the_gathers_against_the_reference[rocm:gfx942": "",
    "test_v41_rocm_keylist.py::test_sweep_drives_the_key_lists": "",
    "test_v41_rocm_shared.py::test_sweep_drives_the_engram_ops_on_rocm": "",
    "test_v41_rocm_prefill.py::test_sweep_prefill_steps_launch_the_in_tree_prefill[rocm:gfx942": "",
    "test_v41_nvfp4_gather.py::test_every_nibble_and_scale_by_hand": "",
    "test_sweep_rocm.py::test_fp8_indexer_drives_the_localization_on_gfx950_with_aiter[rocm:gfx942": "",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import triton

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 8):
        return
    skip = pytest.mark.skip(reason=f"Triton {triton.__version__}: no e4m3fnuz in its interpreter, no bf16 -0.0, no gfx1250 link (3.8+ runs it)")
    for item in items:
        name = item.nodeid.rsplit("/", 1)[-1]
        if any(name.startswith(prefix) and needle in name for prefix, needle in _BEFORE_3_8.items()):
            item.add_marker(skip)
