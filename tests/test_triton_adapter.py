"""One test per Triton internal that warmreg._triton relies on (run on Triton 3.6, 3.7, 3.8 and 3.9 in CI).

If a Triton upgrade moves one of them, the failure shows up here, by name.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import warmreg
from tests.helpers import _scale_kernel
from warmreg import _triton
from warmreg._triton import cache as _triton_cache
from warmreg._triton import interp as _triton_interp
from warmreg._triton import release as _triton_release
from warmreg._triton.hits import load_hit
from warmreg._triton.release import RELEASE
from warmreg.values.platform import Platform

H100 = Platform.parse("cuda:90")
ONLY_36 = pytest.mark.skipif(
    RELEASE.per_signature_launcher is False,
    reason=f"Triton {triton.__version__} builds no C launcher per kernel (3.7+): nothing to lock or build",
)


@pytest.mark.parametrize("version", ["3.6.0", "3.6.1", "3.7.1", "3.8.0", "3.9.0", "3.8.0+git1234"])
def test_version_check_accepts_every_supported_release(version: str) -> None:
    _triton.check_version(version)


def test_version_check_refuses_an_unsupported_release_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_triton_release.ALLOW_UNSUPPORTED, raising=False)
    _triton.check_version()
    for version in ("3.10.0", "3.5.1", "4.0.0"):
        with pytest.raises(_triton.UnsupportedTriton, match=rf"Triton {version} is not supported") as info:
            _triton.check_version(version)
        assert "\n" not in str(info.value) and _triton_release.ALLOW_UNSUPPORTED in str(info.value)


def test_unsupported_release_opt_in_warns_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_triton_release.ALLOW_UNSUPPORTED, "1")
    with pytest.warns(RuntimeWarning, match=r"Triton 3\.10\.0, which it was not checked against"):
        _triton.check_version("3.10.0")
    assert _triton_release.release_of("3.10.0") is _triton_release.RELEASES[_triton_release.SUPPORTED_TRITON[-1]]


def test_release_table_row_matches_the_installed_triton() -> None:
    """Each field of the installed release's row, read again from that release's own source."""
    import inspect

    import triton.backends.nvidia.driver as nvidia_driver
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction, serialize_specialization_data

    assert RELEASE.series == ".".join(triton.__version__.split(".")[:2])
    serialize = inspect.getsource(serialize_specialization_data)
    assert RELEASE.specialization_has_target == ("target" in inspect.signature(serialize_specialization_data).parameters)
    assert RELEASE.jit_function_constants == ("jit_function" in serialize)
    assert RELEASE.constexpr_lists_as_tuples == ("convert_to_tuple_if_list(value['constexpr'])" in inspect.getsource(JITFunction.preload))
    assert RELEASE.per_signature_launcher == hasattr(nvidia_driver, "make_launcher")
    own_del = vars(CompiledKernel).get("__del__")
    assert RELEASE.unloads_on_del == (own_del is not None and "unload_module" in inspect.getsource(own_del))
    import re

    added = re.findall(r'kwargs\["(\w+)"\] = knobs\.(\w+\.\w+)', inspect.getsource(JITFunction.run))
    assert tuple(added) == RELEASE.run_option_knobs


def test_run_kwargs_adds_what_jit_run_adds() -> None:
    full = _triton.run_kwargs(_scale_kernel, {"n": 1}, {"num_warps": 2})
    assert full["n"] == 1 and full["num_warps"] == 2 and full["debug"] in (False, None)
    assert {name for name, _ in RELEASE.run_option_knobs} <= set(full)


def test_compile_hook_sees_a_compile_and_chains_the_previous_hook(triton_cache: Path) -> None:
    seen: list[_triton.CompileRequest] = []
    before: list[str] = []
    triton.knobs.runtime.jit_cache_hook = lambda **kw: before.append(kw["key"])
    try:
        handle = _triton.install_compile_hook(seen.append)
        x = warmreg.meta((64,), torch.float16)
        with _triton.cross_target(H100):
            _triton.warmup(_scale_kernel, (1,), dict(x_ptr=x, out_ptr=x, n=48, scale=1.0, BLOCK=64), {"num_warps": 2})
        _triton.remove_compile_hook(handle)
        assert _triton.get_jit_cache_hook() is not handle.hook
    finally:
        hook = triton.knobs.runtime.jit_cache_hook
        triton.knobs.runtime.jit_cache_hook = None
    assert hook is not None and len(seen) == 1 and before == [seen[0].key]
    request = seen[0]
    assert request.jit_name == "tests.helpers._scale_kernel" and request.jit is _scale_kernel
    assert request.specialization["num_warps"] == 2 and request.specialization["signature"]["n"] == "i32"
    assert json.loads(request.specialization_data or "{}")["name"] == "tests.helpers._scale_kernel"


def test_compile_listener_reports_compiles_and_cache_hits(triton_cache: Path) -> None:
    events: list[bool] = []
    x = warmreg.meta((64,), torch.float16)
    kwargs = dict(x_ptr=x, out_ptr=x, n=80, scale=1.0, BLOCK=64)
    with _triton.compile_listener(lambda hit, _meta: events.append(hit)), _triton.cross_target(H100):
        _triton.warmup(_scale_kernel, (1,), kwargs, {})
        _triton.forget_compiled()
        _triton.warmup(_scale_kernel, (1,), kwargs, {})
    assert events == [False, True]
    assert triton.knobs.compilation.listener is None


def test_kernels_share_one_metadata_class_inside_the_block_only(triton_cache: Path) -> None:
    import collections

    x = warmreg.meta((64,), torch.float16)

    def compiled(n: int) -> object:
        return _triton.warmup(_scale_kernel, (1,), dict(x_ptr=x, out_ptr=x, n=n, scale=1.0, BLOCK=64), {})

    original = collections.namedtuple
    with _triton.cross_target(H100):
        apart = compiled(16), compiled(17)  # two binaries (n divisible by 16 or not)
        _triton.forget_compiled()
        with _triton.shared_kernel_objects():
            with _triton.shared_kernel_objects():  # nested: still shared after the inner block
                first = compiled(16)
            second = compiled(17)  # a cache hit: Triton's CompiledKernel.__init__ makes the class
            point = collections.namedtuple("Point", "x y")  # anyone else's namedtuple is untouched
        _triton.forget_compiled()
        after = compiled(16), compiled(17)
    assert collections.namedtuple is original
    assert first.hash != second.hash and type(first.metadata) is type(second.metadata)
    assert first.metadata == apart[0].metadata and second.metadata == apart[1].metadata
    assert type(first.metadata).__module__ == "triton.compiler.compiler"
    assert type(apart[0].metadata) is not type(apart[1].metadata) and type(after[0].metadata) is not type(after[1].metadata)
    assert point.__module__ == __name__ and point(1, 2).y == 2 and point is not collections.namedtuple("Point", "x y")


def test_cross_target_swaps_and_restores_the_driver() -> None:
    from triton.runtime.driver import driver

    before = driver._active
    with _triton.cross_target(H100):
        assert driver.active.get_current_target() == triton.backends.compiler.GPUTarget("cuda", 90, 32)
    assert driver._active is before


def test_specialization_key_is_the_key_triton_caches_under() -> None:
    x = warmreg.meta((64,), torch.float16)
    kwargs = dict(x_ptr=x, out_ptr=x, n=64, scale=1.0, BLOCK=64)
    with _triton.cross_target(H100):
        key = _triton.specialization_key(_scale_kernel, kwargs, {"num_warps": 2})
        _triton.warmup(_scale_kernel, (1,), kwargs, {"num_warps": 2})
        assert key in _scale_kernel.device_caches[_triton.current_device()][0]
    spec, options = _triton.parse_specialization_key(key)  # type: ignore[misc]
    assert spec[2] == ("i32", "D") and options["num_warps"] == 2


def test_local_cache_hash_matches_the_directory_triton_wrote(triton_cache: Path) -> None:
    seen: dict[str, str] = {}

    def hook(**kw):  # type: ignore[no-untyped-def]
        seen["data"] = kw["compile"]["specialization_data"]

    x = warmreg.meta((64,), torch.float16)
    triton.knobs.runtime.jit_cache_hook = hook
    try:
        with _triton.cross_target(H100):
            compiled = _triton.warmup(_scale_kernel, (1,), dict(x_ptr=x, out_ptr=x, n=17, scale=1.0, BLOCK=64), {})
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    local = _triton_cache.local_cache_hash(_scale_kernel, seen["data"], H100)
    assert local == compiled.hash
    assert (triton_cache / _triton_cache.cache_subdir(local)).is_dir()


def _scale_launch(n: int) -> tuple[dict[str, object], dict[str, int]]:
    x = warmreg.meta((64,), torch.float16)
    return dict(x_ptr=x, out_ptr=x, n=n, scale=1.0, BLOCK=64), {"num_warps": 2}


def test_a_bound_launch_hashes_as_its_decoded_specialization_and_triton_do(triton_cache: Path) -> None:
    """The hash warm remembers while binding (from the source Triton compiles) equals the one decoded
    from the serialized specialization (packs, other ranks) and the directory Triton's compile wrote."""
    kwargs, options = _scale_launch(19)
    with _triton.cross_target(H100):
        key, data = _triton_cache.specialize_remembered(_scale_kernel, kwargs, options, H100)
        assert (key, data) == _triton.specialize(_scale_kernel, kwargs, options)
        bound = _triton_cache.local_cache_hash(_scale_kernel, data, H100)
        _triton_cache._hashes.clear()
        assert _triton_cache.local_cache_hash(_scale_kernel, data, H100) == bound
        compiled = _triton.warmup(_scale_kernel, (1,), kwargs, options)
    assert compiled.hash == bound


def test_binding_takes_a_decoded_specialization_as_recorded_only_where_key_and_options_agree(
    triton_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A specialization this process decoded (a pack's install) is what binding returns for a launch with the
    same in-memory key and parsed options, without Triton's ``_pack_args``; any other launch is specialized."""
    from warmreg._triton import compiler as _compiler

    kwargs, options = _scale_launch(27)
    with _triton.cross_target(H100):
        key, data = _triton.specialize(_scale_kernel, kwargs, options)
        recorded = json.dumps(json.loads(data), indent=1)  # the same specialization, serialized elsewhere (a pack)
        assert recorded != data
        _triton_cache._hashes.clear(), _triton_cache._decoded.clear()
        installed = _triton_cache.local_cache_hash(_scale_kernel, recorded, H100)  # as a pack install decodes it
        packed: list[str] = []
        real = _compiler.pack_bound
        monkeypatch.setattr(_compiler, "pack_bound", lambda jit, k, bound: packed.append(k) or real(jit, k, bound))
        assert _triton_cache.specialize_remembered(_scale_kernel, kwargs, options, H100) == (key, recorded)
        assert packed == [] and _triton_cache.local_cache_hash(_scale_kernel, recorded, H100) == installed
        other = _triton_cache.specialize_remembered(_scale_kernel, kwargs, {"num_warps": 4}, H100)  # another key
        assert packed == [other[0]] != [key]
        for entry, (text, parsed) in list(_triton_cache._decoded.items()):  # a parsed option differs: specialized again
            _triton_cache._decoded[entry] = (text, {**parsed, "enable_fp_fusion": not parsed["enable_fp_fusion"]})
        assert _triton_cache.specialize_remembered(_scale_kernel, kwargs, options, H100) == (key, data)
        assert packed == [other[0], key]


def test_a_binder_made_ahead_serves_only_its_own_target_and_binds_as_tritons_own() -> None:
    """``prepare_binders`` (a prefetched pack's functions) makes what ``create_binder`` makes at a function's first
    launch on a device; binding takes it for a device of that target, and Triton makes its own for any other."""
    from warmreg._triton import compiler as _compiler

    kwargs, options = _scale_launch(31)
    sm90, sm80 = _triton.gpu_target(H100), _triton.gpu_target(Platform.parse("cuda:80"))
    with _triton.cross_target(H100):
        device = _triton.current_device()
        expected = _triton.specialize(_scale_kernel, kwargs, options)  # Triton's own binder
        saved = _scale_kernel.device_caches.pop(device)
        try:
            _triton.prepare_binders([_scale_kernel], sm80)
            assert _triton.specialize(_scale_kernel, kwargs, options) == expected
            assert (_scale_kernel, sm80) in _compiler._binders  # another target's: left alone
            assert _scale_kernel.device_caches[device][4] is not _compiler._binders[(_scale_kernel, sm80)][1]
            del _scale_kernel.device_caches[device]
            _triton.prepare_binders([_scale_kernel], sm90)
            backend, binder = _compiler._binders[(_scale_kernel, sm90)]
            assert _triton.specialize(_scale_kernel, kwargs, options) == expected
            assert _scale_kernel.device_caches[device][2:] == (saved[2], backend, binder)
            assert (_scale_kernel, sm90) not in _compiler._binders
        finally:
            _compiler._binders.pop((_scale_kernel, sm80), None)
            _scale_kernel.device_caches[device] = saved


def test_a_warm_reads_the_cache_invalidating_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton._C import libtriton

    real, reads = libtriton.get_cache_invalidating_env_vars, []
    monkeypatch.setattr(libtriton, "get_cache_invalidating_env_vars", lambda: reads.append(1) or real())
    monkeypatch.delenv("TRITON_DISABLE_LINE_INFO", raising=False)
    with _triton_cache.fixed_env():
        before = _triton_cache._env()
        monkeypatch.setenv("TRITON_DISABLE_LINE_INFO", "1")
        with _triton_cache.fixed_env():
            assert _triton_cache._env() == before and _triton_cache._env() == before
    assert len(reads) == 1
    assert "TRITON_DISABLE_LINE_INFO" in dict(_triton_cache._env()) and len(reads) == 2


def test_a_hit_loaded_directly_is_the_kernel_tritons_warmup_finds(triton_cache: Path) -> None:
    """load_hit gives what JITFunction.warmup gives on a disk-cache hit: the same binary and metadata,
    the compilation listener told (a hit), the kernel in the jit function's in-memory cache under the key."""
    kwargs, options = _scale_launch(21)
    heard: list[tuple[bool, str]] = []
    with _triton.cross_target(H100):
        key, data = _triton_cache.specialize_remembered(_scale_kernel, kwargs, options, H100)
        assert load_hit(_scale_kernel, key, data, H100) is None  # nothing in the cache yet
        _triton.warmup(_scale_kernel, (1,), kwargs, options)
        _triton.forget_compiled()
        found = _triton.warmup(_scale_kernel, (1,), kwargs, options)  # Triton's own hit
        _triton.forget_compiled()
        with _triton.compile_listener(lambda hit, metadata: heard.append((hit, metadata["hash"]))):
            direct = load_hit(_scale_kernel, key, data, H100)
        assert _scale_kernel.device_caches[_triton.current_device()][0][key] is direct
        assert _triton.in_memory(_scale_kernel, key)
    assert heard == [(True, found.hash)]
    # the IR texts are read when first asked for; every dict operation sees them all the same
    assert isinstance(direct.asm, type(found.asm))  # Triton's AsmDict, as on Triton's own hit
    assert len(direct.asm) == len(found.asm) >= 5 and all(name in direct.asm for name in found.asm)
    assert direct.asm["ptx"] == found.asm["ptx"] and direct.asm.get("no such IR") is None
    with pytest.raises(KeyError):
        direct.asm["no such IR"]
    assert (direct.hash, direct.kernel, direct.metadata, dict(direct.asm)) == (found.hash, found.kernel, found.metadata, dict(found.asm))
    assert direct.metadata_group == found.metadata_group
    assert direct.src.signature == found.src.signature and direct.src.constants == found.src.constants


def test_a_hit_of_an_entry_a_pack_install_published_skips_tritons_group_read(
    triton_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child paths an install remembered serve the hit (no ``get_group``); where they are gone, Triton's read."""
    from triton.runtime.cache import FileCacheManager

    from warmreg._triton import hits

    kwargs, options = _scale_launch(29)
    reads: list[str] = []
    real = FileCacheManager.get_group
    monkeypatch.setattr(FileCacheManager, "get_group", lambda self, name: reads.append(name) or real(self, name))
    with _triton.cross_target(H100):
        key, data = _triton_cache.specialize_remembered(_scale_kernel, kwargs, options, H100)
        found = _triton.warmup(_scale_kernel, (1,), kwargs, options)
        _triton.forget_compiled()
        name = f"{found.name}.json"
        hits.remember_group(str(triton_cache), found.hash, name, found.metadata_group)
        reads.clear()
        direct = load_hit(_scale_kernel, key, data, H100)
        assert reads == [] and (direct.kernel, direct.metadata, direct.metadata_group) == (found.kernel, found.metadata, found.metadata_group)
        assert direct.asm["ptx"] == found.asm["ptx"]
        _triton.forget_compiled()
        gone = {child: str(triton_cache / "removed" / child) for child in found.metadata_group}
        hits.remember_group(str(triton_cache), found.hash, name, gone)
        again = load_hit(_scale_kernel, key, data, H100)
        assert reads == [name] and again.metadata_group == found.metadata_group and again.kernel == found.kernel


def test_a_hit_takes_tritons_own_path_where_a_foreign_hook_must_see_it(triton_cache: Path) -> None:
    kwargs, options = _scale_launch(23)
    with _triton.cross_target(H100):
        key, data = _triton_cache.specialize_remembered(_scale_kernel, kwargs, options, H100)
        _triton.warmup(_scale_kernel, (1,), kwargs, options)
        own = _triton.install_compile_hook(lambda request: None)  # the monitor's kind: still direct
        try:
            assert load_hit(_scale_kernel, key, data, H100) is not None
        finally:
            _triton.remove_compile_hook(own)
        for knob, value in (("jit_cache_hook", lambda **kw: None), ("jit_post_compile_hook", lambda **kw: None)):
            setattr(triton.knobs.runtime, knob, value)
            try:
                assert load_hit(_scale_kernel, key, data, H100) is None, knob
            finally:
                setattr(triton.knobs.runtime, knob, None)
        triton.knobs.compilation.always_compile = True
        try:
            assert load_hit(_scale_kernel, key, data, H100) is None
        finally:
            triton.knobs.compilation.always_compile = False


def test_interpreted_nested_helpers_and_language_restored() -> None:
    from tests.helpers import Scale

    before = dict(vars(tl.core))
    x = torch.randn(40, dtype=torch.float16)
    out = Scale(block=16)(x, 3.0, block=16)
    torch.testing.assert_close(out, (x.float() * 3).half(), rtol=0, atol=0)
    after = dict(vars(tl.core))
    assert {k for k in after if after[k] is not before.get(k)} <= {"__dict__"}


@triton.jit
def _runtime_loop_kernel(x_ptr, n):
    acc = 0
    for i in range(n):
        acc += tl.load(x_ptr + i)
    tl.store(x_ptr, acc)


def test_interpreter_handles_runtime_loop_bounds_with_numpy2() -> None:
    x = torch.arange(6, dtype=torch.int32)
    _triton_interp.interpreted(_runtime_loop_kernel)[(1,)](x, 6)
    assert int(x[0]) == 15


def test_jit_hook_and_listener_slots_exist() -> None:
    assert hasattr(triton.knobs.runtime, "jit_cache_hook")
    assert hasattr(triton.knobs.runtime.kernel_load_start_hook, "add")
    assert hasattr(triton.knobs.compilation, "listener")
    from triton.runtime._async_compile import AsyncCompileMode

    assert callable(AsyncCompileMode)


def test_forget_compiled_drops_in_memory_kernels() -> None:
    x = warmreg.meta((64,), torch.float16)
    with _triton.cross_target(H100):
        _triton.warmup(_scale_kernel, (1,), dict(x_ptr=x, out_ptr=x, n=64, scale=1.0, BLOCK=64), {})
    assert _scale_kernel.device_caches
    _triton.forget_compiled()
    assert not _scale_kernel.device_caches


def test_replay_compiles_a_recorded_specialization(triton_cache: Path) -> None:
    seen: dict[str, str] = {}
    triton.knobs.runtime.jit_cache_hook = lambda **kw: seen.setdefault("d", kw["compile"]["specialization_data"])
    try:
        with _triton.cross_target(H100):
            x = warmreg.meta((64,), torch.float16)
            _triton.warmup(_scale_kernel, (1,), dict(x_ptr=x, out_ptr=x, n=1, scale=1.0, BLOCK=64), {})
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    _triton.forget_compiled()
    compiled = _triton_cache.replay("tests.helpers._scale_kernel", seen["d"], H100)
    assert json.loads(seen["d"])["name"] == "tests.helpers._scale_kernel" and compiled.asm["cubin"]


def test_recorded_library_paths_do_not_travel(triton_cache: Path) -> None:
    """A pack built on another machine records its libdevice path; the local hash must not read it."""
    seen: dict[str, str] = {}

    def hook(**kw):  # type: ignore[no-untyped-def]
        seen["d"] = kw["compile"]["specialization_data"]  # returning None: Triton goes on compiling

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        with _triton.cross_target(H100):
            x = warmreg.meta((64,), torch.float16)
            compiled = _triton.warmup(_scale_kernel, (1,), dict(x_ptr=x, out_ptr=x, n=64, scale=1.0, BLOCK=64), {})
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    data = json.loads(seen["d"])
    assert data["options"]["extern_libs"]  # Triton records absolute paths here
    data["options"]["extern_libs"] = [["libdevice", "/elsewhere/python3.12/libdevice.10.bc"]]
    assert _triton_cache.local_cache_hash(_scale_kernel, json.dumps(data), H100) == compiled.hash


def test_triton_key_prefetch_fills_tritons_own_cache() -> None:
    from triton.runtime import cache

    _triton_cache.prefetch_triton_key()
    _triton_cache.prefetch_triton_key()  # once per process
    _triton_cache.wait_triton_key()
    assert cache.triton_key.cache_info().currsize == 1
    hits = cache.triton_key.cache_info().hits
    assert cache.triton_key().startswith(triton.__version__)
    assert cache.triton_key.cache_info().hits == hits + 1


@ONLY_36
def test_loads_that_share_a_launcher_take_turns_and_others_run_in_parallel() -> None:
    import contextlib
    import itertools
    import threading
    import time
    from types import SimpleNamespace

    spans: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}
    met = threading.Barrier(2, timeout=10)  # deterministic overlap when the two builds may run at once

    class FakeCompiled:  # stands in for CompiledKernel: _init_handles builds the launcher
        module = None

        def __init__(self, group: str, sig: dict[str, str]) -> None:
            self.group = group
            self.src = SimpleNamespace(signature=sig, constants={(3,): 64})
            self.metadata = SimpleNamespace()

        def _init_handles(self) -> None:
            start = time.perf_counter()
            if not spans[self.group]:  # the first build of each launcher waits for the other's
                with contextlib.suppress(threading.BrokenBarrierError):  # no overlap: the assertion below says so
                    met.wait()
            time.sleep(0.05)
            spans[self.group].append((start, time.perf_counter()))
            self.module = object()

    kernels = [FakeCompiled("a", {"x": "*fp32", "n": "i32"}) for _ in range(3)]
    kernels += [FakeCompiled("b", {"x": "*bf16", "n": "i32"}) for _ in range(3)]
    threads = [threading.Thread(target=_triton.finish_load, args=(k,)) for k in kernels]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for group in spans.values():
        ordered = sorted(group)
        assert len(ordered) == 3
        assert all(prev_end <= start for (_, prev_end), (start, _) in itertools.pairwise(ordered))  # one at a time
    a, b = sorted(spans["a"]), sorted(spans["b"])
    assert any(sa < eb and sb < ea for sa, ea in a for sb, eb in b)  # the two launchers built side by side
    _triton.finish_load(kernels[0])  # loaded: a no-op
    assert len(spans["a"]) == 3


@ONLY_36
def test_kernels_that_differ_only_in_a_block_size_share_one_launcher_lock() -> None:
    import torch

    from tests.helpers import _scale_kernel
    from warmreg.values.platform import Platform

    with _triton.cross_target(Platform.parse("cuda:90")):
        x = torch.empty(64, device="meta")
        block64, block128, n_one = (_scale_kernel.warmup(x, x, n, 2.0, BLOCK=b, grid=(1,)) for n, b in [(64, 64), (64, 128), (1, 64)])

    def identity(c: object) -> str:
        return _triton.compiler._launcher_identity(c, c.src.signature, c.src.constants)

    # one C compiler run for both block sizes (Triton's launcher source is the same); n == 1 is a constant: another
    assert identity(block64) == identity(block128) != identity(n_one)


@ONLY_36
def test_a_compile_process_builds_a_launcher_only_when_it_claims_it() -> None:
    import torch

    from tests.helpers import _scale_kernel
    from warmreg._triton import launchers as _triton_launchers
    from warmreg.values.platform import Platform

    with _triton.cross_target(Platform.parse("cuda:90")):
        x = torch.empty(64, device="meta")
        block64, block128 = (_scale_kernel.warmup(x, x, 64, 2.0, BLOCK=b, grid=(1,)) for b in (64, 128))
    claimed: list[str] = []

    def refuse(key: str) -> bool:
        claimed.append(key)
        return False  # another process builds it: nothing is built (no libcuda needed here)

    assert not _triton_launchers.prebuild(block64, refuse) and not _triton_launchers.prebuild(block128, refuse)
    # claimed by the key Triton's compile_module_from_src caches it under: one for both block sizes
    assert claimed == [_triton_launchers.launcher_source(block64)[0]] * 2


@pytest.mark.skipif(RELEASE.per_signature_launcher, reason="Triton 3.6 builds a C launcher per kernel")
def test_a_compile_process_has_no_launcher_to_build_from_37_on() -> None:
    from warmreg._triton import launchers as _triton_launchers

    def claim(key: str) -> bool:
        raise AssertionError("nothing to claim")

    assert _triton_launchers.prebuild(object(), claim) is False


@pytest.mark.skipif(RELEASE.per_signature_launcher, reason="Triton 3.6 builds a C launcher per kernel: its loads take turns")
def test_loads_without_a_per_kernel_launcher_run_side_by_side() -> None:
    import threading
    from types import SimpleNamespace

    met = threading.Barrier(3, timeout=10)  # every load of one signature waits for the others: no lock between them

    class FakeCompiled:
        module = None
        src = SimpleNamespace(signature={"x": "*fp32"}, constants={})
        metadata = SimpleNamespace()

        def _init_handles(self) -> None:
            met.wait()
            self.module = object()

    kernels = [FakeCompiled() for _ in range(3)]
    threads = [threading.Thread(target=_triton.finish_load, args=(k,)) for k in kernels]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(k.module is not None for k in kernels) and not met.broken


def test_nothing_outside_the_adapter_touches_a_private_triton_name() -> None:
    """Triton's internals (runtime, compiler, backends, knobs, _C, underscored names) are reached only
    from the adapter, ``warmreg/_triton/``, and the runtime's guarded fast launch (``runtime/fast.py``),
    which launches a compiled kernel through them; kernels may use the language (``triton.jit``,
    ``triton.language``)."""
    import ast
    from pathlib import Path

    public_modules = ("triton", "triton.language", "triton.language.extra", "triton.language.extra.cuda")
    internal = {"runtime", "compiler", "backends", "knobs", "_C", "tools", "testing"}
    found = []
    package = Path(warmreg.__file__).parent
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        if where.startswith("_triton/") or where == "runtime/fast.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [f"{where}: import {a.name}" for a in node.names if a.name.startswith("triton") and a.name not in public_modules]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("triton"):
                if node.module not in public_modules or any(a.name.startswith("_") for a in node.names):
                    found.append(f"{where}: from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "triton":
                if node.attr in internal or (node.attr.startswith("_") and node.attr != "__version__"):
                    found.append(f"{where}:{node.lineno}: triton.{node.attr}")
    assert found == []


def test_the_ast_race_is_retried_also_when_triton_wraps_it_from_a_called_function() -> None:
    """CPython's ast.parse thread race (gh-106905) in a called jit function reaches warm as Triton's
    ``CompilationError(src, node, None) from SystemError``: compiled again, like the bare race."""
    from triton.compiler.errors import CompilationError

    from warmreg.pipeline.bind import describe

    def wrapped(calls: list[int], cause: BaseException) -> str:
        calls.append(1)
        if len(calls) == 1:
            try:
                raise cause
            except BaseException as inner:
                src = "def f():\n    g()"
                raise CompilationError(src, ast.parse(src).body[0].body[0], None) from inner  # type: ignore[attr-defined]
        return "compiled"

    calls: list[int] = []
    race = SystemError("AST constructor recursion depth mismatch (before=10, after=12)")
    assert _triton.retrying_ast_race(wrapped, calls, race) == "compiled" and len(calls) == 2
    calls = []
    with pytest.raises(CompilationError) as info:  # a real error in the callee is not retried
        _triton.retrying_ast_race(wrapped, calls, NameError("name 'x' is not defined"))
    assert len(calls) == 1 and "NameError: name 'x' is not defined" in describe(info.value)


def test_preimport_takes_the_imports_of_a_first_specialization() -> None:
    """In a fresh process, after ``preimport()`` a first specialization (what a warm's binding does)
    imports no Triton module: every name the adapter lists exists on this release and covers them."""
    import subprocess
    import sys

    code = """
import sys, torch, warmreg
from warmreg import _triton
from warmreg.values.platform import Platform
from tests.helpers import _scale_kernel
missing = [m for m in _triton.compiler._LAZY_IMPORTS if __import__("importlib.util").util.find_spec(m) is None]
_triton.preimport()
before = set(sys.modules)
with _triton.cross_target(Platform.parse("cuda:90")):
    x = warmreg.meta((64,), torch.float16)
    _triton.specialize(_scale_kernel, dict(x_ptr=x, out_ptr=x, n=64, scale=1.0, BLOCK=64), {})
print(missing, sorted(m for m in set(sys.modules) - before if m.startswith("triton")))
"""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[] []", out.stdout
