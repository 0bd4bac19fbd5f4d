"""A pack of vLLM's own Triton kernels for a deployment on a profiled GPU, built on a machine without one.

:func:`build_vllm_pack` takes vLLM's registrations and keys for the deployment
(:func:`~warmreg_vllm.registry_keys.registered_kernels`' construction, under
:func:`~warmreg_vllm.emulation.emulate_gpu` and :func:`~warmreg_vllm.construction.meta_rank`), compiles every key of
every ``triton`` kernel with vLLM's own ``compile(key)`` (``JITFunction.warmup``: no launch) for the profile's
target inside :func:`warmreg.record_pack` (a fresh Triton cache, Triton's driver for the target), and writes a
pack in warmreg's format. Its manifest's ``engine`` section records vLLM's version, the profile, the deployment,
each kernel held (name, key count) and, by name with the reason, each kernel the pack cannot hold: CuTeDSL and
TileLang kernels (not compiled by Triton), autotuned kernels (vLLM benchmarks them by launching on the GPU) and
kernels whose keys need a live GPU. ``warmreg pack install`` installs it (the functions come from the installed
vLLM through :mod:`warmreg_vllm.pack_functions`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from warmreg import Platform, WarmregError

from .profile import GpuProfile
from .registry_keys import RegisteredKernel, Registrations

__all__ = ["NOT_HELD", "KernelRow", "VllmPack", "VllmPackError", "build_vllm_pack", "compile_keys", "deployment"]

#: Why a Triton pack cannot hold a kernel of each kind other than ``triton``
NOT_HELD = {
    "cutedsl": "a CuTeDSL kernel: CuTeDSL compiles and caches it at vLLM's warmup, not Triton",
    "tilelang": "a TileLang kernel: TileLang compiles and caches it at vLLM's warmup, not Triton",
    "autotuned": "an autotuned Triton kernel: vLLM's warmup launches it on the GPU to benchmark its configs",
    "live-gpu": "its keys need a live GPU",
}


class VllmPackError(WarmregError, RuntimeError):
    """A pack of vLLM's kernels cannot be built for the deployment."""


@attrs.frozen(kw_only=True)
class KernelRow:
    """One kernel of the deployment in a pack's report.

    :param name: vLLM's kernel name. :param kind: how vLLM compiles it (``registry_keys.KINDS``).
    :param keys: its compile keys. :param held: whether the pack holds its binaries.
    :param why: why the pack cannot hold it (``None`` when held).
    """

    name: str
    kind: str
    keys: int
    held: bool
    why: str | None = None

    @classmethod
    def of(cls, kernel: RegisteredKernel) -> KernelRow:
        if kernel.kind == "triton":
            return cls(name=kernel.name, kind=kernel.kind, keys=len(kernel.keys), held=True)
        why = NOT_HELD[kernel.kind] + (f" ({kernel.reason})" if kernel.reason else "")
        return cls(name=kernel.name, kind=kernel.kind, keys=len(kernel.keys), held=False, why=why)


def _rows(items: Iterable[KernelRow]) -> tuple[KernelRow, ...]:
    return tuple(items)


@attrs.frozen(kw_only=True)
class VllmPack:
    """What :func:`build_vllm_pack` wrote, as a vLLM user reads it.

    :param path: the pack. :param vllm_version: the vLLM that registered and compiled the kernels.
    :param profile: the GPU profile. :param model: the deployment's model and its ``model_type``.
    :param kernels: every registered kernel, held or not. :param binaries: the pack's entries (Triton binaries;
        keys that compile to one binary share it). :param size: the pack's bytes on disk.
    :param seconds: wall seconds per phase (vLLM's registration phases, ``compile``, ``write``).
    """

    path: str
    vllm_version: str
    profile: GpuProfile
    model: str
    model_type: str
    kernels: tuple[KernelRow, ...] = attrs.field(converter=_rows)
    binaries: int
    size: int
    seconds: dict[str, float] = attrs.field(eq=False)

    def held(self) -> tuple[KernelRow, ...]:
        return tuple(k for k in self.kernels if k.held)

    def not_held(self) -> tuple[KernelRow, ...]:
        return tuple(k for k in self.kernels if not k.held)

    def engine_section(self) -> dict[str, Any]:
        """The pack manifest's ``engine`` section."""
        return {
            "name": "vllm", "version": self.vllm_version, "profile": self.profile.to_dict(),
            "deployment": {"model": self.model, "model_type": self.model_type},
            "kernels": [{"name": k.name, "keys": k.keys} for k in self.held()],
            "not_held": [{"name": k.name, "kind": k.kind, "keys": k.keys, "why": k.why} for k in self.not_held()],
        }  # fmt: skip

    def summary(self) -> str:
        """The report: kernels and keys, held or not and why, the pack's binaries, size and time."""
        held, rest = self.held(), self.not_held()
        lines = [
            f"{self.path}: vLLM {self.vllm_version} kernels of {self.model} ({self.model_type}) for {self.profile.name}"
            f" ({self.profile.triton_target.target})",
            f"  holds {sum(k.keys for k in held)} keys of {len(held)} Triton kernels in {self.binaries} binaries,"
            f" {self.size / 2**20:.1f} MiB; compiled in {self.seconds.get('compile', 0.0):.0f} s",
            f"  cannot hold {sum(k.keys for k in rest)} keys of {len(rest)} kernels (vLLM's warmup compiles them on the GPU)",
            "",
            f"  {'kernel':<48} {'kind':<9} {'keys':>5}  held",
        ]
        for k in held + rest:
            lines.append(f"  {k.name:<48} {k.kind:<9} {k.keys:>5}  {'yes' if k.held else 'no: ' + str(k.why)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values."""
        return {
            **self.engine_section(),
            "path": self.path,
            "binaries": self.binaries,
            "size": self.size,
            "seconds": self.seconds,
        }


@contextlib.contextmanager
def deployment(config: Any, profile: GpuProfile) -> Iterator[tuple[Any, Registrations]]:
    """vLLM's registrations for the deployment (as :func:`~warmreg_vllm.registry_keys.registered_kernels` computes
    them), with the block still inside the emulation and the meta-device rank, where vLLM's ``compile(key)`` runs as
    on the GPU. Yields the ``VllmConfig`` and the registrations. One deployment per process.
    """
    from warmreg import cross_target

    from . import registry_keys as rk
    from .construction import meta_rank
    from .emulation import emulate_gpu

    seconds: dict[str, float] = {}
    with emulate_gpu(profile):
        with rk._timed(seconds, "config"):
            vllm_config = rk._vllm_config(config)
            rk._check_runner(vllm_config)
        with meta_rank(vllm_config):
            registries = rk._run_points(vllm_config, profile, seconds)
            with rk._timed(seconds, "keys"), cross_target(Platform.parse(profile.triton_target.target)):
                kernels = rk._collect(registries, vllm_config)
            yield vllm_config, Registrations(kernels=sorted(kernels), seconds=seconds, registries=registries)


def compile_keys(
    kernels: Iterable[RegisteredKernel],
    *,
    workers: int = 1,
    label: Callable[[RegisteredKernel, str], Any] | None = None,
) -> dict[str, str]:
    """Compile each key of ``kernels`` with vLLM's own ``compile(key)``, on ``workers`` threads of Triton's async
    compile pool (as vLLM's own warmup does on CUDA), inside :func:`deployment` and a Triton target. ``label`` gives
    a context manager each key's compile runs in. Returns ``"<kernel> <key>": error`` for each key whose ``compile``
    raised, or whose compile on the pool raised (Triton's ``AsyncCompileMode(ignore_errors=True)`` drops that error
    and leaves no binary: the pool keeps it under the key that submitted the compile).
    """
    import triton

    failed: dict[str, str] = {}
    pool = _Pool(workers, failed) if workers > 1 else None

    def compile_all() -> None:
        for kernel in kernels:
            for text, key in zip(kernel.keys, kernel.vllm_keys):
                with label(kernel, text) if label is not None else contextlib.nullcontext():
                    if pool is not None:
                        pool.submitter = f"{kernel.name} {text}"
                    try:
                        kernel.kernel.compile(key)
                    except Exception as e:  # one key's failure is reported, the others compile
                        failed[f"{kernel.name} {text}"] = f"{type(e).__name__}: {e}"

    if pool is None:
        compile_all()
    else:
        with pool, triton.AsyncCompileMode(pool, ignore_errors=True):
            compile_all()
    return failed


class _Pool(ThreadPoolExecutor):
    """Triton's async compile pool, keeping the error of each compile that raised on it under :attr:`submitter`
    (the key whose ``compile`` submitted it; the keys are submitted from one thread)."""

    def __init__(self, workers: int, failed: dict[str, str]) -> None:
        super().__init__(max_workers=workers)
        self.failed, self.submitter = failed, ""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        future = super().submit(fn, *args, **kwargs)
        where = self.submitter
        future.add_done_callback(lambda f: self._keep(where, f))
        return future

    def _keep(self, where: str, future: Any) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            self.failed.setdefault(where, f"{type(error).__name__}: {error}")


def build_vllm_pack(
    config: Any, profile: GpuProfile, out: str | os.PathLike[str], *, workers: int | None = None, force: bool = False
) -> VllmPack:
    """Build a pack of every Triton key vLLM's registry warms for a deployment on ``profile``'s GPU.

    ``config`` is vLLM's ``EngineArgs`` (as ``vllm serve`` takes them) or a ``VllmConfig`` built inside
    :func:`~warmreg_vllm.emulation.emulate_gpu`. Run it in a fresh process (one deployment per process, and
    :func:`warmreg.record_pack` records only what Triton compiles in it).

    :param out: a directory, or a file ending in ``.tar``, ``.tar.gz`` or ``.zip``.
    :param workers: compile threads (default: this machine's CPUs).
    :param force: replace an existing output.
    :raises VllmPackError: if a key fails to compile or the deployment has no Triton key (no pack is written).
    :raises PackError: if the output exists (without ``force``) or cannot be written.
    """
    from importlib.metadata import version

    from warmreg import record_pack

    workers = workers or os.cpu_count() or 1
    with deployment(config, profile) as (vllm_config, found):
        model = vllm_config.model_config
        triton_kernels = [k for k in found.kernels if k.kind == "triton" and k.keys]
        if not triton_kernels:
            raise VllmPackError(
                f"vLLM registers no Triton key for {model.model} on {profile.name}", fix="check the engine arguments"
            )
        report = VllmPack(
            path=os.fspath(out), vllm_version=version("vllm"), profile=profile, model=str(model.model),
            model_type=str(model.hf_config.model_type), kernels=[KernelRow.of(k) for k in found.kernels], binaries=0, size=0,
            seconds=found.seconds,
        )  # fmt: skip
        start = time.perf_counter()
        with record_pack(
            out,
            target=profile.triton_target.target,
            model_type=report.model_type,
            engine=report.engine_section(),
            force=force,
        ) as recording:

            def label(kernel: RegisteredKernel, text: str) -> Any:
                key_type = type(kernel.vllm_keys[0])
                return recording.key(
                    kernel=kernel.name, key=text, kind=f"{key_type.__module__}.{key_type.__qualname__}"
                )

            failed = compile_keys(triton_kernels, workers=workers, label=label)
            found.seconds["compile"] = time.perf_counter() - start
            if failed:
                first = next(iter(failed.items()))
                raise VllmPackError(
                    f"{len(failed)} key(s) failed to compile; first: {first[0]}: {first[1]}", fix="no pack was written"
                )
        found.seconds["write"] = time.perf_counter() - start - found.seconds["compile"]
    entries = len(recording.manifest.entries) if recording.manifest is not None else 0  # set when the block ends
    return attrs.evolve(report, binaries=entries, size=_size(Path(out)), seconds=found.seconds)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
