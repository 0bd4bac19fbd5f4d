"""Host cost of one launch, every path side by side in one process, on the local GPU.

After warming the config (the monitor off), for warmreg's fused Q/KV RMSNorm at T = 1 (the decode
hot path, where host cost is all there is), interleaved over ``--rounds`` rounds so drift of the host
affects every path alike; each figure is microseconds per call over batches of ``--calls`` launches
(fewer than the driver's launch queue holds, so the GPU never throttles the host):

- ``driver``: a bare ``cuLaunchKernelEx`` of the same function with the same parameters, prepared once, issued
  by one call into a minimal C function (``benchmarks/_driver_floor.py``): the cheapest launch Python can make.
- ``floor``: the compiled kernel's own launcher (``CompiledKernel.run``) called with prepared
  arguments: grid, stream and every argument computed once. Triton's launcher cannot go lower.
- ``fast``: warmreg's guarded launch with the same kwargs: the C entry (``warmreg.runtime._cdispatch``).
- ``fast_getters``: the same C entry reading each tensor through torch.Tensor's getters, not torch's C shim.
- ``fast_unwatched``: the same C entry running its environment checks at every launch (``_cdispatch.watch(False)``
  while it is made: as on CPython before 3.12), not only after a binding they read changed.
- ``driver_then_pack`` / ``driver_then_context``: the driver launch, then the entry's guards and packing
  (``Entry.pack``, no launch) / torch's two Python getters: what each costs in the cache state a launch leaves
  (``paired_ratios`` subtracts the driver's time of the same round).
- ``fast_python``: the same guards in the generated Python function (the path without a C compiler).
- ``triton_prealloc``: ``kernel[grid](...)`` with preallocated outputs.
- ``triton_same_alloc``: the same, allocating the two outputs with the op's own allocation calls.
- ``op``: the whole warmreg op (checks, dispatch, two allocations, fast launch).
- ``op_out``: the op with ``out=`` (preallocated outputs: nothing allocated).
- ``op_python``: the op on the Python fast path; ``op_out_python`` likewise with ``out=``.

Then the first launch after warm against the steady state: a fresh process's first call of the op
(launch + synchronize) against the median of the next ``--steady`` identical calls.

    python benchmarks/launch_floor.py [examples/deepseek_v4_flash.json] [--tag NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, qkv_decode_inputs, write
from _driver_floor import build as build_driver_floor
from _driver_floor import prepare as prepare_driver_floor

import warmreg
import warmreg.runtime.fast
import warmreg.runtime.launch
from warmreg.ops import FusedQKVRMSNorm, fused_qkv_rmsnorm_reference
from warmreg.ops.qkv_rmsnorm import _fused_qkv_rmsnorm_kernel
from warmreg.runtime import _cdispatch

ROOT = Path(__file__).resolve().parents[1]


def _host_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


@contextlib.contextmanager
def _getter_reads() -> Iterator[None]:
    """Entries built meanwhile read tensors through torch.Tensor's getters (no dtype numbers for the shim)."""
    saved = warmreg.runtime.fast._dtype_code
    warmreg.runtime.fast._dtype_code = lambda dtype: -1  # type: ignore[assignment]
    try:
        yield
    finally:
        warmreg.runtime.fast._dtype_code = saved


def _synced_ms(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default=str(ROOT / "examples" / "deepseek_v4_flash.json"))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--steady", type=int, default=50)
    ap.add_argument("--tag", default="h200")
    args = ap.parse_args()

    dev = torch.device("cuda")
    torch.empty(1, device=dev)  # an engine has CUDA up before it warms
    t = time.perf_counter()
    report = warmreg.warm(args.config, on_error="continue", progress=False)
    warm_s = time.perf_counter() - t
    op = warmreg.plan(args.config).kernel(FusedQKVRMSNorm.name).kernel
    a, b, qw, kvw = qkv_decode_inputs(op, dev)
    q_out, kv_out = torch.empty_like(a), torch.empty_like(b)
    torch.cuda.synchronize()

    # 1. the first launch after warm, then the same launch steady
    first_ms = _synced_ms(lambda: op(a, b, qw, kvw, 1e-6))
    steady = [_synced_ms(lambda: op(a, b, qw, kvw, 1e-6)) for _ in range(args.steady)]
    got = op(a, b, qw, kvw, 1e-6)
    ref = fused_qkv_rmsnorm_reference(a, b, qw, kvw, 1e-6)
    for x, y in zip(got, ref):
        torch.testing.assert_close(x, y, atol=0, rtol=2**-7)

    # 2. the paths, side by side
    spec = type(op).__call__.__wrapped__(op, a, b, qw, kvw, 1e-6, out=(q_out, kv_out))
    key, grid, kwargs = spec.key, spec.grid, dict(spec.kwargs)
    options = op.launch_options(key)
    entry = warmreg.runtime.launch.FAST_TABLES[op.name][key]
    compiled = entry.compiled
    jit = _fused_qkv_rmsnorm_kernel
    bound, specialization, _ = jit.device_caches[torch.cuda.current_device()][4](**kwargs, **options)
    prepared = [bound[p.name] for p in jit.params]
    stream = torch.cuda.current_stream().cuda_stream
    run, fn, packed = compiled.run, compiled.function, compiled.packed_metadata
    g = (*grid, 1, 1)[:3]

    def floor() -> None:
        run(g[0], g[1], g[2], stream, fn, packed, None, None, None, *prepared)

    driver_floor = build_driver_floor()
    pdl = bool(getattr(compiled.metadata, "launch_pdl", False))
    prepare_driver_floor(driver_floor, compiled, g, stream, specialization, prepared, launch_pdl=pdl)
    q_out.zero_(), kv_out.zero_()
    driver_floor.launch()  # the same outputs as Triton's launch: the parameters are the ones it passes
    torch.cuda.synchronize()
    for x, y in zip((q_out, kv_out), ref):
        torch.testing.assert_close(x, y, atol=0, rtol=2**-7)

    def triton_prealloc() -> None:
        jit[grid](**kwargs, **options)

    def two_outputs() -> tuple[torch.Tensor, torch.Tensor]:  # the op's own allocation calls
        return a.new_empty_strided(a.shape, (a.shape[1], 1)), b.new_empty_strided(b.shape, (b.shape[1], 1))

    def triton_same_alloc() -> None:
        new_q, new_kv = two_outputs()
        jit[grid](**{**kwargs, "q_out_ptr": new_q, "kv_out_ptr": new_kv}, **options)

    native = entry.launch
    python = entry.python
    # the same C entry reading tensors through torch.Tensor's getters instead of torch's C shim
    with _getter_reads():
        getters = warmreg.runtime.fast.build(jit, kwargs, options, compiled, torch.cuda.current_device())
    assert getters is not None and getters.native is not None
    # the same C entry with its environment checks run at every launch (not watched: CPython before 3.12)
    watched = _cdispatch.watch(False)
    try:
        unwatched = warmreg.runtime.fast.build(jit, kwargs, options, compiled, torch.cuda.current_device())
    finally:
        _cdispatch.watch(watched)
    assert unwatched is not None and unwatched.native is not None and not unwatched.native.watched
    get_device, get_stream = warmreg.runtime.fast._device_getter(), triton.runtime.driver.active.get_current_stream
    dev_index = torch.cuda.current_device()
    pack = entry.native.pack

    def driver_then_pack() -> None:  # the guards and the parameter packing, in the cache state a launch leaves
        driver_floor.launch()
        pack(grid, kwargs)

    def driver_then_context() -> None:  # torch's two Python getters, likewise
        driver_floor.launch()
        get_device()
        get_stream(dev_index)

    def on_python(fn: Callable[[], object]) -> Callable[[], object]:
        def call() -> object:
            entry.launch = python
            try:
                return fn()
            finally:
                entry.launch = native

        return call

    paths: dict[str, Callable[[], object]] = {
        "driver": driver_floor.launch,
        "floor": floor,
        "fast": lambda: native(grid, kwargs),
        "fast_getters": lambda: getters.native.launch(grid, kwargs),
        "fast_unwatched": lambda: unwatched.native.launch(grid, kwargs),
        "driver_then_pack": driver_then_pack,
        "driver_then_context": driver_then_context,
        "fast_python": lambda: python(grid, kwargs),
        "triton_prealloc": triton_prealloc,
        "triton_same_alloc": triton_same_alloc,
        "op": lambda: op(a, b, qw, kvw, 1e-6),
        "op_out": lambda: op(a, b, qw, kvw, 1e-6, out=(q_out, kv_out)),
        "op_python": on_python(lambda: op(a, b, qw, kvw, 1e-6)),
        "op_out_python": on_python(lambda: op(a, b, qw, kvw, 1e-6, out=(q_out, kv_out))),
    }
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, path in paths.items():
            samples[name].append(_host_us(path, args.calls))
    med = {name: median(values) for name, values in samples.items()}
    # the ratio within each round, where both ran back to back
    paired = {
        "triton_prealloc_over_fast": median([t / f for t, f in zip(samples["triton_prealloc"], samples["fast"])]),
        "op_over_triton_same_alloc": median([o / t for o, t in zip(samples["op"], samples["triton_same_alloc"])]),
        "op_out_over_triton_prealloc": median([o / t for o, t in zip(samples["op_out"], samples["triton_prealloc"])]),
        "fast_over_floor": median([f / fl for f, fl in zip(samples["fast"], samples["floor"])]),
        "fast_over_driver": median([f / d for f, d in zip(samples["fast"], samples["driver"])]),
        "fast_getters_over_driver": median([f / d for f, d in zip(samples["fast_getters"], samples["driver"])]),
        "fast_unwatched_over_driver": median([f / d for f, d in zip(samples["fast_unwatched"], samples["driver"])]),
        "fast_unwatched_minus_fast_us": median([u - f for u, f in zip(samples["fast_unwatched"], samples["fast"])]),
        "driver_then_pack_minus_driver_us": median([p - d for p, d in zip(samples["driver_then_pack"], samples["driver"])]),
        "driver_then_context_minus_driver_us": median([c - d for c, d in zip(samples["driver_then_context"], samples["driver"])]),
        "floor_over_driver": median([f / d for f, d in zip(samples["floor"], samples["driver"])]),
    }
    body = type(op).__call__.__wrapped__
    parts = {
        "launch code (checks, dispatch, 2 allocations, LaunchSpec)": lambda: body(op, a, b, qw, kvw, 1e-6),
        "launch code with out=": lambda: body(op, a, b, qw, kvw, 1e-6, out=(q_out, kv_out)),
        "dispatch (the key)": lambda: op.dispatch(qr=a, kv=b, q_weight=qw, kv_weight=kvw, launch_pdl=key.launch_pdl),
        "2 allocations": two_outputs,
        "warmreg.runtime.launch.run (the fast launch and its lookups)": lambda: warmreg.runtime.launch.run(op, spec),
    }
    breakdown = {name: median([_host_us(p, args.calls) for _ in range(3)]) for name, p in parts.items()}
    out = {
        "config": args.config,
        "warm": {"wall_s": warm_s, "summary": report.summary()},
        "kernel": f"{op.name} T=1 {key}",
        "native_built": entry.native is not None,
        "tensor_abi": warmreg.runtime.fast._tensor_abi(),
        "calls_per_sample": args.calls,
        "samples_us": samples,
        "median_us": med,
        "paired_ratios": paired,
        "breakdown_us": breakdown,
        "first_launch_ms": first_ms,
        "steady_launch_ms": steady,
        "first_over_steady": first_ms / median(steady),
    }
    path = write(f"launch_floor_{args.tag}", out)
    print({k: round(v, 2) for k, v in med.items()}, {k: round(v, 3) for k, v in paired.items()})
    print("first/steady:", round(out["first_over_steady"], 3), round(first_ms, 4), round(median(steady), 4))
    print("->", path)


if __name__ == "__main__":
    main()
