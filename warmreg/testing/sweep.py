"""The sweep-driver protocol: how a model family's plugin drives its kernels like an engine in the zero-JIT sweep.

``benchmarks/sweep.py`` warms a config, arms the monitor in ``error`` mode and runs engine steps of random
request mixes through every kernel of ``warmreg.plan(config)``. It names no plugin: each plugin ships a
:class:`Sweep` subclass, its *driver*, and declares it under the entry-point group :data:`GROUP`::

    [project.entry-points."warmreg.sweep"]
    kimi_k3 = "warmreg_kimi_k3.sweep:KimiSweep"

:func:`driver_for` picks the driver of a plan's model type and refuses a plan kernel it does not drive. Drivers
live in their own module, which the plugin's registration module never imports: importing a plugin registers
nothing and pulls no sweep in.
"""

from __future__ import annotations

import abc
import importlib.metadata
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

import warmreg
from warmreg.ops import block_table_slot_mapping_reference, block_table_width, fused_qkv_rmsnorm_reference

from .sweep_batch import KINDS, Batch, Limits, Step, make_batch

__all__ = [
    "GROUP", "KINDS", "NORM", "PLATFORM_FIELDS", "SLOTS", "Batch", "KernelStats", "Limits", "Step", "Sweep", "SweepError",
    "compare", "driver_for", "make_batch", "run_steps", "sweep_drivers",
]  # fmt: skip

log = logging.getLogger("warmreg")
#: The entry-point group of the sweep drivers: ``name = "package.module:DriverClass"``.
GROUP = "warmreg.sweep"
#: The shared block-table slot mapping (``warmreg.ops``): :meth:`Sweep.slot_mapping` drives it, and :meth:`Sweep.qkv_norm`
#: the norm; both are in :attr:`Sweep.drives`.
SLOTS = "warmreg.ops.block_table_slot_mapping"
#: The shared Q/KV RMSNorm (``warmreg.ops``).
NORM = "warmreg.ops.fused_qkv_rmsnorm"
#: Key fields a CPU run takes from its own (absent) platform rather than from the planned target.
PLATFORM_FIELDS = frozenset({"launch_pdl"})
_BF16, _I32, _I64 = torch.bfloat16, torch.int32, torch.int64
_StepT = TypeVar("_StepT", bound=Step)


class SweepError(RuntimeError):
    """The sweep cannot run a config: no driver for its model type, a plan kernel its driver does not drive, or
    ``--device cuda`` without a GPU. A test kit's error, not warmreg's: no :class:`warmreg.WarmregError`.

    :param message: what went wrong, naming the config and the offender.
    :param kernels: the plan kernels without a driver, if that is the problem.
    :param fix: what to do about it; appended to the message.
    """

    def __init__(self, message: str, *, kernels: tuple[str, ...] = (), fix: str | None = None) -> None:
        self.kernels, self.fix = kernels, fix
        super().__init__(f"{message}; fix: {fix}" if fix else message)


@dataclass
class KernelStats:
    """What one kernel did in a config's sweep."""

    launches: int = 0
    misses: dict[str, dict[str, Any]] = field(default_factory=dict)  # explanation -> count, first batch
    failures: dict[str, dict[str, Any]] = field(default_factory=dict)  # error -> count, first batch
    checks: list[str] = field(default_factory=list)

    @staticmethod
    def note(where: dict[str, dict[str, Any]], text: str, batch: str) -> None:
        """Count ``text`` in ``where`` (:attr:`misses` or :attr:`failures`), keeping the batch that first had it."""
        where.setdefault(text, {"count": 0, "first_batch": batch})["count"] += 1

    def to_json(self, monitor: dict[str, int] | None) -> dict[str, Any]:
        """The kernel's results, with the monitor's counters of it as a cross-check."""
        misses = sum(e["count"] for e in self.misses.values())
        return {
            "launches": self.launches,
            "misses": misses,
            "failures": sum(e["count"] for e in self.failures.values()),
            "miss_explanations": [{"explain": k, **v} for k, v in self.misses.items()],
            "failure_messages": [{"error": k, **v} for k, v in self.failures.items()],
            "checks": self.checks,
            "monitor": monitor,  # launches counted before Triton compiles, so a miss is a launch there too
            "monitor_agrees": monitor is not None and monitor["launches"] == self.launches + misses,
        }


def compare(got: Any, want: Any, atol: float, rtol: float) -> str | None:
    """None when the outputs equal the reference's: integers exactly, floats within ``atol``/``rtol``.

    :param got: a tensor or a tuple of tensors (a None in it is skipped).
    :param want: the reference's, of the same structure.
    :returns: what differs, naming the output, or None.
    """
    pairs = list(zip(got, want)) if isinstance(got, tuple) else [(got, want)]
    for i, (g, w) in enumerate(pairs):
        if g is None:
            continue
        g, w = g.cpu(), w.cpu()
        if g.dtype.is_floating_point:
            try:
                torch.testing.assert_close(g, w, atol=atol, rtol=rtol)
            except AssertionError as exc:
                return f"output {i}: {str(exc).splitlines()[0]}"
        elif g.shape != w.shape or not torch.equal(g, w):
            return f"output {i} differs from the reference (shapes {tuple(g.shape)} and {tuple(w.shape)})"
    return None


class Sweep(abc.ABC, Generic[_StepT]):
    """One config's engine: the plan, persistent tables, caches and buffers, and what each kernel did.

    The subclass contract (a plugin's driver):

    - :attr:`model_types`: the config model types it drives; :attr:`drives`: every kernel name it launches
      (``Sweep.drives``, the shared kernels, included). :func:`driver_for` refuses a plan kernel outside it.
    - ``__init__(plan, dev, lim, seed)`` calls this one first, then builds the family's caches and buffers and
      sets :attr:`layers` (the layer types a step launches). Its random draws come from :attr:`gen` (tensors) and
      :attr:`rng` (choices), in a fixed order: results stay comparable between runs only while they do.
    - :meth:`step_tensors` builds a step's :class:`Step` (or the family's subclass of it) from a batch;
      :meth:`run` launches one step. Every launch goes through :meth:`launch`, which records misses and failures
      instead of raising; anything :meth:`run` raises outside a launch is recorded as a step failure.
    - :meth:`speculative_tokens` may be overridden where the config spells its draft tokens differently.
    """

    #: The config model types this driver drives.
    model_types: ClassVar[tuple[str, ...]] = ()
    #: The kernels this driver launches: a subclass adds its own to these.
    drives: ClassVar[frozenset[str]] = frozenset({SLOTS, NORM})

    def __init__(self, plan: warmreg.Plan, dev: torch.device, lim: Limits, seed: int) -> None:
        self.plan, self.cfg, self.dev, self.lim = plan, plan.config, dev, lim
        self.cuda = dev.type == "cuda"
        self.gen = torch.Generator(device=dev).manual_seed(seed)
        self.rng = random.Random(seed + 1)
        self.names = frozenset(kp.name for kp in plan.kernels)
        self.stats = {name: KernelStats() for name in sorted(self.names)}
        self.where = ""
        self.step_failures: list[str] = []
        self.layers: list[tuple[str, int]] = []
        keys = plan.kernel(SLOTS).keys if SLOTS in self.names else ()
        self.groups = sorted({k.block_size for k in keys})  # type: ignore[attr-defined]
        self.tables = {bs: self.block_table(block_table_width(lim.max_model_len, bs)) for bs in self.groups}
        self.slot_buf = {bs: torch.full((lim.max_tokens,), -1, dtype=_I64, device=dev) for bs in self.groups}

    @classmethod
    def speculative_tokens(cls, cfg: warmreg.WarmConfig) -> int:
        """Draft tokens a decode request carries beyond its one (``serving.num_speculative_tokens``, else 0)."""
        return int(cfg.serving.get("num_speculative_tokens") or 0)

    @abc.abstractmethod
    def step_tensors(self, b: Batch) -> _StepT:
        """The tensors of one step (:meth:`Step.of`, with the family's per-step fields)."""

    @abc.abstractmethod
    def run(self, st: _StepT) -> None:
        """Launch every kernel of one step."""

    def layer_types(self) -> list[str]:
        """The layer types a step launches (each once)."""
        return [kind for kind, _ in self.layers]

    def kernel(self, name: str) -> Any:
        """The planned kernel object of ``name`` (its launcher)."""
        return self.plan.kernel(name).kernel

    def randn(self, *shape: int, dtype: torch.dtype = _BF16, scale: float = 1.0) -> torch.Tensor:
        """Normal values times ``scale``, drawn from :attr:`gen` in fp32, then cast to ``dtype``."""
        return torch.randn(shape, generator=self.gen, device=self.dev).mul_(scale).to(dtype)

    def block_table(self, width: int) -> torch.Tensor:
        """A persistent block table ``[max_seqs, width]`` of random, valid page ids (request ``r`` owns row ``r``)."""
        shape = (self.lim.max_seqs, width)
        return torch.randint(0, self.lim.num_blocks, shape, generator=self.gen, device=self.dev, dtype=_I32)

    def launch(
        self,
        name: str,
        what: str,
        fn: Callable[[], Any],
        *,
        fallback: Callable[[], Any] | None = None,
        ref: Callable[[], Any] | None = None,
        tol: tuple[float, float] = (0.0, 2**-7),
    ) -> Any:
        """Launch ``name`` through ``fn``; on a miss or a failure record it and return ``fallback()`` (or None).

        On the CPU the first launch of a kernel with a reference ``ref`` is checked against it. The reference runs
        first (some kernels update inputs in place); floats must agree within ``tol = (atol, rtol)`` (default: one
        bf16 rounding, both sides computing in fp32 in different orders).
        """
        stat, batch = self.stats[name], f"{self.where}; {what}"
        want = None
        if ref is not None and not self.cuda and not stat.checks:
            try:
                want = ref()
            except Exception as exc:  # a reference that cannot take the inputs is a finding, not a launch failure
                stat.checks.append(f"{batch}: the reference raised {type(exc).__name__}: {exc}"[:800])
        try:
            out = fn()
            if self.cuda:
                torch.cuda.synchronize()  # an asynchronous fault is charged to this launch, not a later one
        except warmreg.JitMissError as exc:
            KernelStats.note(stat.misses, exc.miss.explain(), batch)
            return fallback() if fallback is not None else None
        except Exception as exc:  # anything else fails the sweep: recorded, and the step goes on
            KernelStats.note(stat.failures, f"{type(exc).__name__}: {exc}"[:800], batch)
            return fallback() if fallback is not None else None
        stat.launches += 1
        if want is not None:
            stat.checks.append(f"{batch}: " + (compare(out, want, *tol) or "matches the PyTorch reference"))
        return out

    def step(self, b: Batch, index: int) -> None:
        """One engine step; an error outside a launch (inputs, a fallback) is recorded as a step failure."""
        self.where = f"step {index} ({b.describe()})"
        try:
            self.run(self.step_tensors(b))
        except Exception as exc:
            self.step_failures.append(f"{self.where}: {type(exc).__name__}: {exc}"[:800])

    def slot_mapping(self, st: Step, bs: int) -> None:
        """The block-table slot mapping of one KV-cache group, into its persistent (graph-padded) buffer."""
        table, buf, T = self.tables[bs], self.slot_buf[bs], st.batch.tokens

        def torch_slots() -> torch.Tensor:
            buf[:T] = table.long()[st.token_to_req.long(), st.positions // bs] * bs + st.positions % bs
            buf[T:] = -1
            return buf

        out = self.launch(
            SLOTS,
            f"KV group of block size {bs}",
            lambda: self.kernel(SLOTS)(st.qsl, st.positions, table, buf, block_size=bs),
            fallback=torch_slots,
            ref=lambda: block_table_slot_mapping_reference(
                st.qsl, st.positions, table, block_size=bs, max_num_tokens=buf.shape[0]
            ),
        )
        st.slots[bs] = out[:T]

    def qkv_norm(self, st: Step, layer: str, q: int, kv: int, width: int, eps: float) -> None:
        """The Q/KV RMSNorm of one layer type: ``qr`` and ``kv`` are column views of one fused projection (not
        planned on ROCm with aiter, whose fused op runs instead)."""
        if NORM not in self.names:
            return
        proj = self.randn(st.batch.tokens, width, scale=2.0)
        args = (proj[:, :q], proj[:, q : q + kv], self.randn(q).add_(1), self.randn(kv).add_(1), eps)
        self.launch(
            NORM,
            f"{layer} layer, projection width {width}",
            lambda: self.kernel(NORM)(*args),
            ref=lambda: fused_qkv_rmsnorm_reference(*args),
        )

    def results(self, mon: warmreg.Monitor) -> dict[str, Any]:
        """Per kernel: launches, misses, failures, checks and the monitor's counters; keys outside the plan."""
        counters = mon.counters()
        kernels = {name: s.to_json(counters.get(name)) for name, s in self.stats.items()}
        return {
            "kernels": kernels,
            "not_launched": [n for n, k in kernels.items() if not k["launches"] and not k["misses"]],
            "keys_outside_plan": self.outside_plan(mon),
            "step_failures": self.step_failures,
        }

    def outside_plan(self, mon: warmreg.Monitor) -> list[dict[str, Any]]:
        """Every key launched that the plan does not hold, with the fields that differ from the nearest planned key.

        ``platform_only`` marks keys of a CPU run that differ only in fields set from the CPU's platform.
        """
        out = []
        for name in sorted(self.names):
            planned = set(self.plan.kernel(name).keys)
            for key in sorted(mon.used_keys(name) - planned, key=lambda k: k.sort_key()):
                nearest = min(planned, key=lambda p: (len(p.diff(key)), p.sort_key()), default=None)
                diff = nearest.diff(key) if nearest is not None else ()
                out.append(
                    {
                        "kernel": name,
                        "key": str(key),
                        "differs_from_plan_in": [str(d) for d in diff],
                        "platform_only": not self.cuda and bool(diff) and all(d.field in PLATFORM_FIELDS for d in diff),
                    }
                )
        return out


def sweep_drivers() -> dict[str, type[Sweep[Any]]]:
    """The installed drivers (entry-point group :data:`GROUP`) by the model types they declare.

    A driver whose import fails with ``ImportError`` (a missing optional dependency) is skipped with a logged
    reason, as the core skips such a plugin; anything else propagates.

    :raises warmreg.PluginError: for an entry point that is no :class:`Sweep` subclass or declares no model type,
        or two drivers of one model type (naming both).
    """
    drivers: dict[str, type[Sweep[Any]]] = {}
    for ep in sorted(importlib.metadata.entry_points(group=GROUP), key=lambda e: e.name):
        try:
            cls = ep.load()
        except ImportError as exc:
            log.warning("warmreg sweep driver %s skipped: %s", ep.value, exc)
            continue
        if not (isinstance(cls, type) and issubclass(cls, Sweep)) or not cls.model_types:
            raise warmreg.PluginError(
                ep.value, f"the {GROUP} entry point {ep.name!r} is not a Sweep subclass with model_types",
                fix="point it at a subclass of warmreg.testing.sweep.Sweep that sets model_types and drives",
            )  # fmt: skip
        for model_type in cls.model_types:
            other = drivers.setdefault(model_type, cls)
            if other is not cls:
                raise warmreg.PluginError(
                    ep.value, f"drives model type {model_type!r}, as {other.__module__}.{other.__qualname__} does",
                    fix="uninstall one of the two plugins",
                )  # fmt: skip
    return drivers


def driver_for(plan: warmreg.Plan, drivers: Mapping[str, type[Sweep[Any]]] | None = None) -> type[Sweep[Any]]:
    """The driver of ``plan``'s model type, checked to drive every kernel of the plan.

    :param drivers: model type -> driver (default: :func:`sweep_drivers`, the installed ones).
    :raises SweepError: when no driver serves the model type, or the plan has kernels the driver does not drive
        (naming them, in ``.kernels``).
    """
    drivers = sweep_drivers() if drivers is None else drivers
    source, model_type = plan.config.source, plan.config.model_type
    cls = drivers.get(model_type)
    if cls is None:
        known = ", ".join(sorted(drivers)) or "none"
        raise SweepError(
            f"{source}: no sweep driver for model type {model_type!r} (installed for: {known})",
            fix=f"install the plugin of {model_type!r}, whose pyproject declares its driver under {GROUP!r}",
        )
    undriven = tuple(sorted({kp.name for kp in plan.kernels} - cls.drives))
    if undriven:
        raise SweepError(
            f"{source}: the plan has kernels this sweep has no driver for: {', '.join(undriven)}",
            kernels=undriven,
            fix=f"drive them in {cls.__module__}.{cls.__qualname__} and add them to its drives",
        )
    return cls


def run_steps(
    plan: warmreg.Plan, seed: int, *, device: str = "cpu", max_tokens: int = 3, max_seq_len: int = 16, max_seqs: int = 2
) -> dict[str, Any]:
    """One step of each kind (decode with unequal lengths, prefill, mixed) of ``plan``'s driver under the monitor in
    ``error`` mode, as ``benchmarks/sweep.py`` starts a CPU sweep: a plugin test's sweep of a few tiny steps through
    Triton's interpreter. Returns the driver's :meth:`Sweep.results` (``step_failures``, ``not_launched``, and per
    kernel its launches, failures, misses and reference checks).

    :raises SweepError: as :func:`driver_for`, for a plan kernel no driver drives.
    """
    driver = driver_for(plan)
    spec = driver.speculative_tokens(plan.config)
    dev = torch.device(device)
    lim = Limits.of(plan.config, cuda=dev.type == "cuda", spec=spec, max_tokens=max_tokens, max_seq_len=max_seq_len, max_seqs=max_seqs)
    sweep, rng = driver(plan, dev, lim, seed), random.Random(seed)
    mon = warmreg.arm("error")
    try:
        for i, kind in enumerate(KINDS):
            sweep.step(make_batch(rng, kind, lim, mix_decode=i == 0), i)
    finally:
        warmreg.disarm(mon)
    return sweep.results(mon)
