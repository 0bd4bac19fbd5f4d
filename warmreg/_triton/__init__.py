"""The Triton adapter: everything warmreg knows about Triton's internals, one module per concern.

``release`` (what each supported release does differently), ``target`` (the local GPU or a cross
target's stand-in driver), ``compiler`` (specialization, compile-only warmup, async compiles, loads),
``hooks`` (the pre-compile, JIT-cache and load hooks, the autotuner's bench), ``cache`` (the disk
cache and its key), ``hits`` (a disk-cache hit loaded without Triton's second binding), ``deferred`` (Triton's launcher object made at its first use), ``interp`` (the interpreter for CPU launches) and ``launchers`` (Triton 3.6's
per-signature C launchers, built for packs and shared within a warm). This package re-exports the
first four's functions, so the rest of warmreg calls ``_triton.<name>``.

Each function names the releases it was checked against (3.6.0, 3.7.1, 3.8.0, 3.9.0 unless it says
otherwise). ``tests/test_triton_adapter.py`` tests each internal the adapter relies on, on every
supported release in CI, so a Triton upgrade that moves one fails there first, and
:func:`check_version` refuses an unsupported release with one readable line.
"""

from __future__ import annotations

from .compiler import (
    async_compile,
    binding_started,
    builds_on_load,
    cache_files,
    compile_listener,
    finish_load,
    forget_compiled,
    full_name,
    in_memory,
    is_future_kernel,
    is_jit,
    knob,
    param_names,
    parse_specialization_key,
    preimport,
    prepare_binders,
    retrying_ast_race,
    run_kwargs,
    shared_kernel_objects,
    source_hash,
    specialization_key,
    specialize,
    warmup,
)
from .deferred import launcher_now
from .hooks import (
    CompileRequest,
    HookHandle,
    add_load_hook,
    get_jit_cache_hook,
    install_compile_hook,
    load_hooks,
    remove_compile_hook,
    remove_load_hook,
    set_jit_cache_hook,
    unwrap_autotuner_bench,
    wrap_autotuner_bench,
)
from .release import RELEASE, SUPPORTED_TRITON, UnsupportedTriton, check_version
from .target import (
    benchmark,
    compile_worker,
    cross_target,
    current_device,
    device_name,
    gpu_target,
    local_targets,
    set_device,
    torch_device,
)

__all__ = [
    "CompileRequest",
    "HookHandle",
    "RELEASE",
    "SUPPORTED_TRITON",
    "UnsupportedTriton",
    "add_load_hook",
    "async_compile",
    "benchmark",
    "binding_started",
    "builds_on_load",
    "cache_files",
    "check_version",
    "compile_listener",
    "compile_worker",
    "cross_target",
    "current_device",
    "device_name",
    "finish_load",
    "forget_compiled",
    "full_name",
    "get_jit_cache_hook",
    "gpu_target",
    "in_memory",
    "install_compile_hook",
    "is_future_kernel",
    "is_jit",
    "knob",
    "launcher_now",
    "load_hooks",
    "local_targets",
    "param_names",
    "parse_specialization_key",
    "preimport",
    "prepare_binders",
    "remove_compile_hook",
    "remove_load_hook",
    "retrying_ast_race",
    "run_kwargs",
    "set_device",
    "set_jit_cache_hook",
    "shared_kernel_objects",
    "source_hash",
    "specialization_key",
    "specialize",
    "torch_device",
    "unwrap_autotuner_bench",
    "warmup",
    "wrap_autotuner_bench",
]
