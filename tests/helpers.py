"""Small kernels and plugins used by the core tests (real Triton kernels, tiny shapes)."""

from __future__ import annotations

import contextlib
import signal
import site
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
import triton
import triton.language as tl

import warmreg

#: The start of a warm subprocess's script in the interrupt tests: SIGINT as a terminal's process has it, whatever
#: this process passes on (a suite started in the background, ``cmd &`` without job control, runs with SIGINT
#: ignored, and its children inherit that; a warm so started rightly ignores Ctrl-C).
SIGINT_AS_IN_A_TERMINAL = (
    "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})\n"
)


@contextlib.contextmanager
def sigint_as_in_a_terminal() -> Iterator[None]:
    """:data:`SIGINT_AS_IN_A_TERMINAL` for this process while the block runs (main thread), then as it was."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


@attrs.frozen(kw_only=True)
class ScaleKey(warmreg.CompileKey):
    dtype: str
    block: int
    n_class: warmreg.values.key.IntClass
    aligned: bool
    num_warps: int


class Scale(warmreg.TritonKernel[ScaleKey]):
    """out = x * scale, one program per BLOCK elements; n is a specialized int."""

    name = "tests.scale"
    key_type = ScaleKey
    jit = _scale_kernel

    def __init__(self, *, sizes: Iterable[int] = (1, 16, 17), block: int = 64) -> None:
        self.sizes = tuple(sizes)
        self.block = block

    def dispatch(self, *, x: torch.Tensor, block: int) -> ScaleKey:
        return ScaleKey(
            dtype=str(x.dtype).removeprefix("torch."),
            block=block,
            n_class=warmreg.int_class(x.numel()),
            aligned=warmreg.is_aligned(x),
            num_warps=4 if block >= 128 else 2,
        )

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {
            "x": [warmreg.meta((n,), torch.float16) for n in self.sizes],
            "block": [self.block],
            "only_for_when": [0, 1],  # read by when() only: must never reach the key
        }

    def when(self, *, only_for_when: int, **_: Any) -> bool:
        return only_for_when == 0

    def warmup_inputs(self, key: ScaleKey) -> Mapping[str, Any]:
        n = warmreg.int_class_rep(key.n_class)
        return {"x": warmreg.meta((n,), getattr(torch, key.dtype), offset=0 if key.aligned else 1), "scale": 2.0, "block": key.block}

    @warmreg.kernel_launcher
    def __call__(self, x: torch.Tensor, scale: float, block: int = 64) -> warmreg.LaunchSpec[ScaleKey]:
        key = self.dispatch(x=x, block=block)
        out = torch.empty_like(x)
        grid = (triton.cdiv(x.numel(), block),) if x.numel() else None
        return warmreg.LaunchSpec(key, grid, dict(x_ptr=x, out_ptr=out, n=x.numel(), scale=scale, BLOCK=block), out)


class CountedScale(Scale):
    """:class:`Scale` that counts, per key, how often a warm runs the key's launch code
    (``launch_for_warm``: ``warmup_inputs``, then the launcher)."""

    name = "tests.counted_scale"
    calls: ClassVar[Counter[ScaleKey]] = Counter()

    def warmup_inputs(self, key: ScaleKey) -> Mapping[str, Any]:
        CountedScale.calls[key] += 1
        return super().warmup_inputs(key)


@triton.jit
def _broken_kernel(x_ptr, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), undefined_name)  # noqa: F821 - fails to compile on purpose


@attrs.frozen
class BrokenKey(warmreg.CompileKey):
    block: int


class Broken(warmreg.TritonKernel[BrokenKey]):
    """A kernel whose compile fails (an undefined name), to test isolation of failures."""

    name = "tests.broken"
    key_type = BrokenKey
    jit = _broken_kernel

    def dispatch(self, *, block: int) -> BrokenKey:
        return BrokenKey(block)

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"block": [32]}

    def warmup_inputs(self, key: BrokenKey) -> Mapping[str, Any]:
        return {"x": warmreg.meta((key.block,), torch.float32), "block": key.block}

    @warmreg.kernel_launcher
    def __call__(self, x: torch.Tensor, block: int) -> warmreg.LaunchSpec[BrokenKey]:
        return warmreg.LaunchSpec(self.dispatch(block=block), (1,), dict(x_ptr=x, BLOCK=block))


class Plugin:
    """A plugin object registering the given kernels (with optional predicates)."""

    def __init__(self, *entries: Any) -> None:
        self.entries = entries

    @warmreg.hookimpl
    def warmreg_register_kernels(self, registry: warmreg.Registry) -> None:
        for entry in self.entries:
            kernel, when = entry if isinstance(entry, tuple) else (entry, True)
            registry.add(kernel, when=when)


CONFIG = {"model": {"model_type": "test"}, "serving": {"max_num_batched_tokens": 64}}


@triton.jit
def _tuned_double_kernel(x_ptr, out_ptr, block_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2, mask=mask)
    if tl.program_id(0) == 0:
        tl.store(block_ptr, BLOCK)  # which candidate ran


@attrs.frozen(kw_only=True)
class TunedKey(warmreg.CompileKey):
    dtype: str
    config: int | None = None


class TunedDouble(warmreg.TritonKernel[TunedKey]):
    """out = 2 * x with two autotune candidates (BLOCK 16 on 1 warp, BLOCK 64 on 2); ``block[0]``
    tells which one ran."""

    name = "tests.tuned_double"
    key_type = TunedKey
    jit = _tuned_double_kernel
    tune_configs = (
        warmreg.TuneConfig(constexprs={"BLOCK": 16}, num_warps=1),
        warmreg.TuneConfig(constexprs={"BLOCK": 64}, num_warps=2),
    )

    def __init__(self, *, dtypes: Iterable[torch.dtype] = (torch.float32,)) -> None:
        self.dtypes = tuple(dtypes)

    def dispatch(self, *, x: torch.Tensor) -> TunedKey:
        return TunedKey(dtype=warmreg.dtype_name(x.dtype))

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        return {"x": [warmreg.meta((100,), d) for d in self.dtypes]}

    def warmup_inputs(self, key: TunedKey) -> Mapping[str, Any]:
        return {"x": warmreg.meta((100,), getattr(torch, key.dtype))}

    @warmreg.kernel_launcher
    def __call__(self, x: torch.Tensor) -> warmreg.LaunchSpec[TunedKey]:
        out, block = torch.empty_like(x), torch.zeros(1, dtype=torch.int32, device=x.device)
        n = x.numel()
        kwargs = dict(x_ptr=x, out_ptr=out, block_ptr=block, n=n)
        return warmreg.LaunchSpec(self.dispatch(x=x), lambda meta: (triton.cdiv(n, meta["BLOCK"]),), kwargs, (out, block))


def venv_beside(path: Path) -> Path:
    """A venv (without pip of its own) that sees this interpreter's packages, and returns its python.

    ``--system-site-packages`` alone exposes the *base* interpreter's site-packages: run from inside a
    venv, it would miss that venv's torch, Triton and warmreg. This interpreter's own site directories are
    added through a ``.pth`` file, after the new venv's (what the new venv installs comes first).
    """
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True, timeout=120)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    (Path(purelib) / "_warmreg_tests_outer_site.pth").write_text("".join(f"{d}\n" for d in dirs if Path(d).is_dir()))
    return python
