"""The C launch path (``warmreg/runtime/_cdispatch.c``) against the Python fast launch and Triton.

On the CPU: the C guards accept exactly the launches the Python guards accept (which
``tests/test_fast_launch.py`` checks against Triton's own binder), the kernel parameters it packs
are the ones Triton's launcher would pass, a refused launch goes to the fallback, and its CUDA
declarations match Triton's ``cuda.h``. On a GPU: the ops launch through it, correctly.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch
import triton

from tests.test_fast_launch import H100, _kwargs, _probe, _specialization, _tensor
from warmreg import _triton
from warmreg.runtime import fast as _triton_fast

cdispatch = pytest.importorskip("warmreg.runtime._cdispatch", reason="warmreg.runtime._cdispatch was not built")


class _Compiled:
    """Stands in for a CompiledKernel of the C path: metadata, no real function (``pack`` only)."""

    function, packed_metadata = 0, (4, 1, 0)

    class metadata:
        global_scratch_size = profile_scratch_size = 0
        tensordesc_meta = None
        instrumentation_mode = ""
        launch_pdl = launch_cooperative_grid = False

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def run(self, *args: Any) -> None:
        self.calls.append(args)


_FORMAT = {"i32": "<i4x", "i64": "<q", "u64": "<Q", "fp32": "<f4x", "u1": "<B7x"}


def _expected(kwargs: dict[str, Any]) -> bytes:
    """What Triton's launcher passes for these arguments: each non-constexpr parameter in order,
    as its specialized C type (a pointer is its ``data_ptr()``), one 8-byte slot each."""
    out = b""
    for param, (ty, _) in zip(_probe.params, _specialization(_probe, kwargs)):
        value = kwargs[param.name]
        if ty == "constexpr" or param.is_constexpr:
            continue
        if ty.startswith("*"):
            out += struct.pack("<Q", value.data_ptr())
        else:
            out += struct.pack(_FORMAT[ty], value)
    return out


def _entry(kwargs: dict[str, Any], compiled: Any = None, *, require_cuda: bool = False) -> Any:
    entry = _triton_fast.build(
        _probe, kwargs, {"num_warps": 4}, compiled or _Compiled(), _triton.current_device(), require_cuda=require_cuda
    )
    assert entry is not None and entry.native is not None
    return entry


@pytest.mark.parametrize("reads", ["shim", "getters"])
@pytest.mark.parametrize(("base_n", "base_loose"), [(32, 32), (17, 1), (2**31 + 16, 5)])
def test_c_guards_accept_exactly_what_the_python_guards_accept(
    base_n: int, base_loose: int, reads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways the C entry reads a tensor: torch's C shim (where found) and torch.Tensor's getters."""
    if reads == "getters":
        monkeypatch.setattr(_triton_fast, "_dtype_code", lambda dtype: -1)
    else:
        assert _triton_fast._tensor_abi(), "torch's C shim (aoti_torch_get_*) was not found or disagreed"
    variants: dict[str, list[Any]] = {
        "x_ptr": [_tensor(torch.float32, 0), _tensor(torch.float32, 1), _tensor(torch.float32, 4), _tensor(torch.float16, 0)],
        "loose_ptr": [_tensor(torch.float32, 0), _tensor(torch.float32, 3), _tensor(torch.int32, 0)],
        "n": [0, 1, 16, 17, 32, -16, -1, 2**31 - 16, 2**31, 2**31 + 1, 2**63, 2**63 + 16, 2**64, -(2**40), True, 16.0],
        "loose_n": [0, 1, 16, 17, 2**31],
        "scale": [0.5, 2.0, 3, True],
        "flag": [True, False, 1],
        "BLOCK": [64, 128, 64.0],
    }  # fmt: skip
    with _triton.cross_target(H100):
        base = _kwargs(n=base_n, loose_n=base_loose)
        entry = _entry(base)
        assert entry.launch == entry.native.launch
        assert entry.native.pack((3,), base) == _expected(base)
        accepted = 0
        for name, values in variants.items():
            for value in values:
                kw = {**base, name: value}
                python = entry.python((3,), kw)
                packed = entry.native.pack((3,), kw)
                assert (packed is not None) is python, (name, value, entry.source)
                if packed is not None:
                    assert packed == _expected(kw), (name, value)
                    accepted += 1
        assert 0 < accepted


def test_the_shim_reads_a_tensor_as_its_getters_do() -> None:
    """``tensor_abi`` finds the at::Tensor inside a torch.Tensor by its ``_cdata`` word, without dereferencing
    a guess, and keeps the getters where the samples are not plain tensors; the dtype numbers it reads are
    torch's ScalarType (one per dtype)."""
    assert _triton_fast._tensor_abi()
    good = (torch.empty(3), torch.arange(8)[2:], torch.nn.Parameter(torch.ones(2, dtype=torch.float16)))
    offset = cdispatch.tensor_abi(good)
    assert offset in (16, 24)  # after PyObject_HEAD: at::Tensor, or MaybeOwned's flag then the tensor
    codes = {
        d: cdispatch.dtype_code(torch.empty(0, dtype=d))
        for d in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.uint8)
    }
    assert len(set(codes.values())) == len(codes) and min(codes.values()) >= 0
    assert cdispatch.dtype_code(torch.zeros(2, 2, dtype=torch.bfloat16).t()) == codes[torch.bfloat16]
    assert cdispatch.dtype_code(object()) == -1
    with pytest.raises(TypeError, match="at least two"):
        cdispatch.tensor_abi((torch.empty(1),))
    try:
        assert cdispatch.tensor_abi((torch.empty(1), 3)) == -1  # not a tensor: the getters stay
        assert cdispatch.dtype_code(torch.empty(1)) == -1
        with _triton.cross_target(H100):
            base = _kwargs()
            assert _entry(base).native.pack((3,), base) == _expected(base)  # built with codes, read by getters
    finally:
        assert cdispatch.tensor_abi(good) == offset


def test_a_refused_launch_goes_to_the_python_path_then_triton() -> None:
    with _triton.cross_target(H100):
        base = _kwargs()
        compiled = _Compiled()
        entry = _entry(base, compiled, require_cuda=True)  # CPU tensors: the C guard refuses them
        assert entry.native.pack((2,), base) is None
        assert entry.launch((2,), base) is True  # the Python fast path took it
        assert compiled.calls[-1][:3] == (2, 1, 1)
        assert entry.launch((2,), {**base, "n": 1}) is False  # refused by both: Triton's path
        assert entry.launch([2], base) is True and len(compiled.calls) == 2  # a list grid: Python's path
        assert entry.native.pack((1, 2, 3, 4), base) is None and entry.native.pack((-1,), base) is None


def test_the_python_path_is_generated_at_its_first_use_and_no_entry_keeps_the_callers_tensors() -> None:
    """Beside a C entry the Python guard function is not generated at build (its compile was most of a
    warm's entry builds); the first launch the C guards refuse generates it, once. An entry holds a
    default Triton filled in, never the tensors it was built from (a key's first launch through Triton
    builds one from the caller's real tensors)."""
    import gc
    import weakref

    with _triton.cross_target(H100):
        base = _kwargs()
        held = weakref.ref(base["x_ptr"])
        compiled = _Compiled()
        _triton_fast._code.cache_clear()
        entry = _entry(base, compiled, require_cuda=True)
        assert _triton_fast._code.cache_info().misses == 0  # nothing generated
        assert entry.launch((2,), base) is True and _triton_fast._code.cache_info().misses == 1
        assert entry.launch((2,), base) is True and _triton_fast._code.cache_info().misses == 1
        assert "def launch(grid, kw):" in entry.source and compiled.calls[-1][:3] == (2, 1, 1)
        del base
        compiled.calls.clear()  # the stand-in launcher's record of what it was passed
        gc.collect()
        assert held() is None


def test_call_shape_knobs_and_hooks_are_guarded() -> None:
    with _triton.cross_target(H100):
        base = _kwargs()
        entry = _entry(base)
        assert entry.native.pack((1,), base) is not None
        # kwargs walked in step with the arguments, by lookup once out of step: any order packs the same
        assert entry.native.pack((1,), dict(reversed(base.items()))) == entry.native.pack((1,), base) == _expected(base)
        assert entry.native.pack((1,), {k: v for k, v in base.items() if k != "flag"}) is None
        assert entry.native.pack((1,), {**base, "extra": 1}) is None
        saved = triton.knobs.runtime.debug
        triton.knobs.runtime.debug = True
        try:
            assert entry.native.pack((1,), base) is None
        finally:
            triton.knobs.runtime.debug = saved
        hook = lambda metadata: None  # noqa: E731
        triton.knobs.runtime.launch_exit_hook.add(hook)
        try:
            assert entry.native.pack((1,), base) is None
        finally:
            triton.knobs.runtime.launch_exit_hook.remove(hook)
        assert entry.native.pack((1,), base) is not None


#: CPython lets an entry watch the bindings its environment checks read (PyDict_Watch, PyType_Watch): 3.12+, not
#: free-threaded builds. Every test below asserts the same launches on either path; only ``watched`` differs.
WATCHES = sys.version_info >= (3, 12) and not sysconfig.get_config_var("Py_GIL_DISABLED")


def _bare_entry(checks: tuple[tuple[Any, str, Any, bool, bool], ...]) -> Any:
    """An entry with no arguments, only environment checks: ``pack((1,), {})`` is ``b""`` where they pass."""
    return cdispatch.Entry(
        function=0, num_warps=4, num_ctas=1, shared=0, launch_pdl=False, cooperative=False, device=0, nkw=0,
        args=(), checks=checks, get_device=lambda: 0, get_stream=lambda device: 0, fallback=None, keep=None,
        require_cuda=False,
    )  # fmt: skip


def test_the_knob_and_hook_checks_are_watched_and_see_every_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's knobs and launch hooks are plain attributes: on 3.12+ the entry runs their checks only after one of
    them changed (``checks_hold`` between), and every way of changing one reaches the next launch."""
    with _triton.cross_target(H100):
        base = _kwargs()
        entry = _entry(base).native
        assert entry.watched is WATCHES
        runtime, hook = triton.knobs.runtime, (lambda metadata: None)
        changes = {  # (change, whether it rebinds something: a hook added to a chain's list only grows the list)
            "an instance attribute": (lambda m: m.setattr(runtime, "debug", True), True),
            "the class attribute behind it": (lambda m: (vars(runtime).pop("debug", None), m.setattr(type(runtime), "debug", True)), True),
            "a launch hook added": (lambda m: runtime.launch_exit_hook.add(hook), False),
            "a hook chain's list replaced": (lambda m: m.setattr(runtime.launch_enter_hook, "calls", [hook]), True),
            "a hook chain replaced": (lambda m: m.setattr(runtime, "launch_enter_hook", triton.knobs.HookChain()), True),
            "a compilation knob": (lambda m: m.setattr(triton.knobs.compilation, "instrumentation_mode", "other"), True),
        }  # fmt: skip
        for what, (change, rebinds) in changes.items():
            assert entry.pack((1,), base) is not None, what
            assert entry.checks_hold is WATCHES, what
            with monkeypatch.context() as m:
                change(m)
                assert entry.checks_hold is (WATCHES and not rebinds), what
                assert entry.pack((1,), base) is None, what
                assert entry.pack((1,), base) is None, what  # and stays refused
            runtime.launch_exit_hook.remove(hook)
            assert entry.pack((1,), base) is not None, what


def test_watched_checks_follow_bases_globals_class_changes_and_mutable_values() -> None:
    class Base:
        flag = 1

    class Owner(Base):
        """Reads ``flag`` from its base class."""

    class Chain:
        def __init__(self) -> None:
            self.calls: list[Any] = []

    owner, chain = Owner(), Chain()
    owner.hook = chain
    scope: dict[str, Any] = {"G": 5, "L": [1]}
    entry = _bare_entry(((owner, "flag", 1, False, False), (scope, "G", 5, False, False), (owner, "hook", chain, True, True)))
    assert entry.watched is WATCHES

    def refused_while(change: Any, undo: Any) -> None:
        assert entry.pack((1,), {}) == b"" and entry.checks_hold is WATCHES
        change()
        assert entry.pack((1,), {}) is None and entry.pack((1,), {}) is None
        undo()
        assert entry.pack((1,), {}) == b""

    refused_while(lambda: setattr(Base, "flag", 2), lambda: setattr(Base, "flag", 1))  # a base class's attribute
    refused_while(lambda: setattr(owner, "flag", 2), lambda: delattr(owner, "flag"))  # shadowed on the instance
    refused_while(lambda: scope.update(G=6), lambda: scope.update(G=5))  # a global
    refused_while(lambda: chain.calls.append(print), chain.calls.clear)  # a hook added to the list in place
    refused_while(lambda: setattr(chain, "calls", [print]), lambda: setattr(chain, "calls", []))

    class Other:
        flag, hook = 2, chain

    refused_while(lambda: setattr(owner, "__class__", Other), lambda: setattr(owner, "__class__", Owner))

    # a mutable value equal to the expected one, not the same object: its contents can change without a binding
    # changing, so this entry checks at every launch
    mutable = _bare_entry(((scope, "L", [1], False, False),))
    assert mutable.pack((1,), {}) == b"" and not mutable.checks_hold
    scope["L"].append(2)
    assert mutable.pack((1,), {}) is None


def test_computed_attributes_keep_the_checks_at_every_launch() -> None:
    class Computed:
        reads = 0

        @property
        def flag(self) -> int:
            type(self).reads += 1
            return 1

    owner = Computed()
    entry = _bare_entry(((owner, "flag", 1, False, False),))
    assert not entry.watched
    for _ in range(3):
        assert entry.pack((1,), {}) == b""
    assert Computed.reads == 3 and not entry.checks_hold


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [("global_scratch_size", 256, "scratch"), ("profile_scratch_size", 64, "scratch"),
     ("tensordesc_meta", [{}], "tensor descriptors"), ("instrumentation_mode", "gsan", "sanitizer")],
)  # fmt: skip
def test_kernels_that_need_tritons_launcher_keep_the_python_path(field: str, value: Any, reason: str) -> None:
    compiled = _Compiled()
    compiled.metadata = type("metadata", (_Compiled.metadata,), {field: value})  # type: ignore[misc]
    refusal = _triton_fast.native_refusal(compiled)
    assert refusal is not None and reason in refusal
    with _triton.cross_target(H100):
        entry = _triton_fast.build(_probe, _kwargs(), {"num_warps": 4}, compiled, _triton.current_device())
        assert entry is not None and entry.native is None and entry.launch == entry.python


def test_the_cuda_declarations_match_tritons_cuda_h(tmp_path: Path) -> None:
    """Every size, offset and constant ``_cdispatch_abi.h`` declares, against the cuda.h Triton ships."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    cuda_include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    source = tmp_path / "abi.c"
    source.write_text(
        '#include "cuda.h"\n#include "_cdispatch_abi.h"\n#include <stddef.h>\n'
        "#define SAME(a, b) _Static_assert((a) == (b), #a)\n"
        "SAME(sizeof(wr_launch_config), sizeof(CUlaunchConfig));\n"
        "SAME(sizeof(wr_launch_attr), sizeof(CUlaunchAttribute));\n"
        "SAME(sizeof(wr_attr_value), sizeof(CUlaunchAttributeValue));\n"
        "SAME(offsetof(wr_launch_attr, value), offsetof(CUlaunchAttribute, value));\n"
        + "".join(
            f"SAME(offsetof(wr_launch_config, {f}), offsetof(CUlaunchConfig, {f}));\n"
            for f in ("gridDimX", "blockDimX", "sharedMemBytes", "hStream", "attrs", "numAttrs")
        )
        + "SAME(offsetof(wr_attr_value, clusterDim.z), offsetof(CUlaunchAttributeValue, clusterDim.z));\n"
        "SAME(WR_ATTR_COOPERATIVE, CU_LAUNCH_ATTRIBUTE_COOPERATIVE);\n"
        "SAME(WR_ATTR_CLUSTER_DIMENSION, CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION);\n"
        "SAME(WR_ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE, CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE);\n"
        "SAME(WR_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n"
        "SAME(WR_CLUSTER_SCHEDULING_POLICY_SPREAD, CU_CLUSTER_SCHEDULING_POLICY_SPREAD);\n"
        "SAME(WR_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED);\n"
        "SAME(WR_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_CONTEXT);\n"
        "SAME(sizeof(wr_result), sizeof(CUresult)); SAME(sizeof(wr_device), sizeof(CUdevice));\n"
        "SAME(sizeof(wr_function), sizeof(CUfunction)); SAME(sizeof(wr_stream), sizeof(CUstream));\n"
    )
    here = Path(_triton_fast.__file__).parent
    out = subprocess.run(
        [cc, "-fsyntax-only", "-std=c11", "-Werror", f"-I{cuda_include}", f"-I{here}", str(source)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert sysconfig.get_config_var("SIZEOF_VOID_P") == 8


class _Counting:
    """A real CompiledKernel whose Triton launcher calls are counted (the Python fast path's and
    Triton's own launches go through it; the C path does not)."""

    def __init__(self, compiled: Any) -> None:
        self.compiled, self.calls = compiled, 0
        self.function, self.packed_metadata, self.metadata = compiled.function, compiled.packed_metadata, compiled.metadata

    def run(self, *args: Any) -> Any:
        self.calls += 1
        return self.compiled.run(*args)


@pytest.mark.gpu
def test_gpu_ops_launch_through_the_c_path() -> None:
    import warmreg
    from warmreg.ops import FusedQKVRMSNorm, fused_qkv_rmsnorm_reference
    from warmreg.runtime.launch import FAST_TABLES, remember_fast_launch

    op = FusedQKVRMSNorm(q_size=96, kv_size=64, proj_width=160)
    dev = torch.device("cuda")
    qw = torch.nn.Parameter(torch.rand(96, device=dev, dtype=torch.bfloat16) + 0.5, requires_grad=False)
    kvw = torch.rand(64, device=dev, dtype=torch.bfloat16) + 0.5
    proj = torch.randn(5, 160, device=dev, dtype=torch.bfloat16)
    a, b = proj[:, :96], proj[:, 96:]
    op(a, b, qw, kvw, 1e-6)  # the first launch: Triton's path, then an entry
    spec = type(op).__call__.__wrapped__(op, a, b, qw, kvw, 1e-6)
    counting = _Counting(FAST_TABLES[op.name][spec.key].compiled)
    jit, options = op.jit_for(spec.key), op.launch_options(spec.key)
    assert remember_fast_launch(op.name, spec.key, jit, spec.kwargs, options, counting, torch.cuda.current_device())
    entry = FAST_TABLES[op.name][spec.key]
    assert entry.native is not None and entry.launch == entry.native.launch
    with warmreg.monitor("error") as mon:
        for step in range(4):
            x = proj * (step + 1)
            q, kv = op(x[:, :96], x[:, 96:], qw, kvw, 1e-6)
            q_ref, kv_ref = fused_qkv_rmsnorm_reference(x[:, :96], x[:, 96:], qw, kvw, 1e-6)
            torch.testing.assert_close(q, q_ref, atol=0, rtol=2**-7)
            torch.testing.assert_close(kv, kv_ref, atol=0, rtol=2**-7)
        # the current stream is read per launch: on the side stream the launch waits for the sleep and the write
        # of its input; on another stream it would read the input before it is written
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(100_000_000)
            x = proj * 7
            q, _ = op(x[:, :96], x[:, 96:], qw, kvw, 1e-6)
        stream.synchronize()
    torch.testing.assert_close(q, fused_qkv_rmsnorm_reference(x[:, :96], x[:, 96:], qw, kvw, 1e-6)[0], atol=0, rtol=2**-7)
    assert counting.calls == 0 and not mon.misses  # every launch went through the C path
    q, _ = op(a.to(torch.float16), b.to(torch.float16), qw.to(torch.float16), kvw.to(torch.float16), 1e-6)
    assert counting.calls == 0  # another key: not this entry's launch at all


def test_a_cross_warm_rehearses_nothing() -> None:
    from tests.helpers import CONFIG, Plugin, Scale

    report = warmreg_warm(CONFIG, plugins=[Plugin(Scale())], entry_points=False, target="cuda:90")
    assert report.stage("rehearsal").get("launched", 0) == 0 and report.stage("rehearsal").get("seconds", 0.0) == 0.0


def warmreg_warm(*args: Any, **kwargs: Any) -> Any:
    import warmreg

    warmreg.reset_state()
    return warmreg.warm(*args, **kwargs)


@pytest.mark.gpu
def test_gpu_warm_rehearses_every_key_once() -> None:
    from tests.helpers import CONFIG, Plugin, Scale

    report = warmreg_warm(CONFIG, plugins=[Plugin(Scale())], entry_points=False)
    assert report.stage("rehearsal").get("launched", 0) == report.declared == 3 and report.stage("rehearsal").get("seconds", 0.0) > 0
    section = report.stage("rehearsal")
    assert 0 < section["synchronize_seconds"] < section["seconds"] and len(section["slowest"]) == 3
    assert {row[0] for row in section["slowest"]} == {"tests.scale"} and all(row[2] > 0 for row in section["slowest"])
    assert warmreg_warm(CONFIG, plugins=[Plugin(Scale())], entry_points=False, rehearse=False).stage("rehearsal").get("launched", 0) == 0

    class Unsafe(Scale):
        rehearse = False

    assert warmreg_warm(CONFIG, plugins=[Plugin(Unsafe())], entry_points=False).stage("rehearsal")["launched"] == 0


@pytest.mark.gpu
def test_gpu_a_second_warm_of_the_same_plan_is_already_warm() -> None:
    import warmreg
    from tests.helpers import CONFIG, Plugin, Scale
    from warmreg.runtime.launch import FAST_TABLES

    first = warmreg_warm(CONFIG, plugins=[Plugin(Scale())], entry_points=False)
    again = warmreg.warm(CONFIG, plugins=[Plugin(Scale())], entry_points=False)
    assert not first.already_warm and again.already_warm and again.declared == first.declared
    FAST_TABLES[Scale.name].clear()  # a key no longer served from memory: warm again for real
    third = warmreg.warm(CONFIG, plugins=[Plugin(Scale())], entry_points=False)
    assert not third.already_warm and len(FAST_TABLES[Scale.name]) == third.declared



def test_the_rehearsal_section_lists_the_slowest_keys_by_host_time() -> None:
    """Each rehearsed key's host time is kept; the report lists the slowest few, slowest first (CPU: the
    interpreter launches), and a key whose inputs launch another key is skipped with why, untimed."""
    import attrs

    from tests.helpers import Scale
    from warmreg.stages import rehearsal

    kernel, stage = Scale(), rehearsal.Rehearse()
    keys = [kernel.dispatch(x=torch.empty(n, dtype=torch.float16), block=64) for n in (1, 17)]
    for key in keys:
        stage._rehearse(kernel.name, kernel, key, torch.device("cpu"))
    other = attrs.evolve(keys[0], block=128)  # its inputs launch block 128 with 4 warps: not this key (2 warps)
    stage._rehearse(kernel.name, kernel, other, torch.device("cpu"))
    assert stage.launched == 2 and [s[0] for s in stage.skipped] == [kernel.name] and "its inputs launch" in stage.skipped[0][2]
    assert [row[1] for row in stage.per_key] == keys and all(row[2] > 0 for row in stage.per_key)
    stage.per_key.extend((f"k{i}", "key", float(i)) for i in range(10))
    slowest = stage.section()["slowest"]
    assert len(slowest) == rehearsal.SLOWEST and [row[2] for row in slowest] == sorted((row[2] for row in slowest), reverse=True)
    assert slowest[0] == ["k9", "key", 9.0]


def test_watching_can_be_turned_off_for_comparisons() -> None:
    """``watch(False)``: entries made meanwhile check at every launch (the benchmark's ``fast_unwatched``)."""
    scope: dict[str, Any] = {"G": 5}
    previous = cdispatch.watch(False)
    try:
        entry = _bare_entry(((scope, "G", 5, False, False),))
    finally:
        assert cdispatch.watch(previous) is False
    assert previous is WATCHES and not entry.watched
    assert entry.pack((1,), {}) == b"" and not entry.checks_hold
    scope["G"] = 6
    assert entry.pack((1,), {}) is None
    assert _bare_entry(((scope, "G", 6, False, False),)).watched is WATCHES
