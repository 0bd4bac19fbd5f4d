"""A GPU's profile: every value vLLM's platform reads from a CUDA device that changes what vLLM registers for JIT
warmup or the keys it computes, recorded once on the GPU and replayed on a machine without one.

Where vLLM reads each field (vLLM 0.33.0 and 0.34.0; paths inside the installed ``vllm`` package):

- ``capability``: ``Platform.get_device_capability`` (``platforms/cuda.py``, NVML or torch), and through it
  ``has_device_capability``, ``is_device_capability``, ``is_device_capability_family`` (``platforms/interface.py``):
  backend choice, DeepGEMM, FusedInvRopeFP8Quant's keys, the router GEMM's Hopper/Blackwell branches.
- ``num_compute_units``: ``CudaPlatformBase.num_compute_units`` (``multi_processor_count``): the top-k/top-p
  sampler kernels' inputs (``v1/sample/ops/topk_topp_sampler.py``), the MLA indexer's scheduler metadata.
- ``name`` and ``total_memory``: ``get_device_name`` and ``get_device_total_memory``: ``EngineArgs``' batch
  defaults (``max_num_batched_tokens``, ``max_num_seqs`` for ``vllm serve``), the Triton attention backends' tuning
  by device name (``v1/attention/backends/triton_attn.py``, ``mla/triton_mla.py``), the start-up plan.
- ``supports_pdl``: ``CudaPlatformBase.is_arch_support_pdl``: the ``launch_pdl`` constexpr of fused kernels
  (``models/common/ops/fused_qk_rmsnorm.py``, ``models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py``).
- ``fp8_dtype``: ``Platform.fp8_dtype`` / ``is_fp8_fnuz``: the dtype of FP8 pointers in keys.
- ``cuda_version``: ``CudaPlatformBase.get_cuda_runtime_major`` (``torch.version.cuda``).
- ``device_count``: ``CudaPlatformBase.device_count`` (config checks of the parallel sizes).
- ``triton_target``: Triton's ``driver.active.get_current_target()``: what the binaries are compiled for.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from warmreg import WarmregError

__all__ = ["FP8_DTYPES", "GpuProfile", "ProfileError", "TritonTarget"]

#: The FP8 dtypes a platform may prefer (OCP e4m3 on NVIDIA; FNUZ on MI300-class AMD GPUs).
FP8_DTYPES = ("float8_e4m3fn", "float8_e4m3fnuz")
_VERSION = re.compile(r"\d+\.\d+(\.\d+)?")


class ProfileError(WarmregError, ValueError):
    """A GPU profile field is missing or invalid.

    :param field: the field's name (``capability``, ``triton_target.arch``).
    :param problem: what is wrong, in the ``must be <expected> (got <actual>)`` shape.
    :param source: the profile file, when read from one.
    """

    def __init__(self, field: str, problem: str, *, source: str | None = None) -> None:
        self.field, self.problem, self.source = field, problem, source
        where = f" in {source}" if source else ""
        super().__init__(
            f"GPU profile field '{field}'{where} {problem}",
            fix="record the profile on the GPU again, or correct the field (integrations/vllm/README.md lists them)",
        )


def _must(field: str, ok: bool, expected: str, value: Any) -> None:
    if not ok:
        raise ProfileError(field, f"must be {expected} (got {value!r})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_name(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _must(attribute.name, isinstance(value, str) and bool(value.strip()), "a non-empty string", value)


def _check_positive(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _must(attribute.name, _is_int(value) and value > 0, "a positive int", value)


def _check_version(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _must(
        attribute.name,
        isinstance(value, str) and _VERSION.fullmatch(value) is not None,
        "a version such as '13.0'",
        value,
    )


def _capability(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _check_capability(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    ok = isinstance(value, tuple) and len(value) == 2 and all(_is_int(v) for v in value)
    _must(
        attribute.name, ok and 3 <= value[0] <= 20 and 0 <= value[1] <= 9, "a [major, minor] pair such as [9, 0]", value
    )


@attrs.frozen(kw_only=True)
class TritonTarget:
    """Triton's ``GPUTarget`` of the device (``driver.active.get_current_target()``).

    :param backend: ``"cuda"`` (the only backend vLLM's CUDA platform compiles for).
    :param arch: the compute capability as Triton writes it (``90`` for sm_90).
    :param warp_size: threads per warp (32 on NVIDIA GPUs).
    """

    backend: str = attrs.field()
    arch: int = attrs.field()
    warp_size: int = attrs.field()

    @backend.validator
    def _backend(self, attribute: attrs.Attribute[str], value: Any) -> None:
        _must("triton_target.backend", value == "cuda", "'cuda'", value)

    @arch.validator
    def _arch(self, attribute: attrs.Attribute[int], value: Any) -> None:
        _must("triton_target.arch", _is_int(value) and 30 <= value < 1000, "a compute capability such as 90", value)

    @warp_size.validator
    def _warp(self, attribute: attrs.Attribute[int], value: Any) -> None:
        _must("triton_target.warp_size", value == 32, "32 (NVIDIA)", value)

    @property
    def target(self) -> str:
        """warmreg's target string (``cuda:90``)."""
        return f"{self.backend}:{self.arch}"


def _triton_target(value: Any) -> Any:
    if isinstance(value, dict):
        keys = {"backend", "arch", "warp_size"}
        _must("triton_target", set(value) == keys, f"an object with exactly {sorted(keys)}", value)
        return TritonTarget(**value)
    return value


@attrs.frozen(kw_only=True)
class GpuProfile:
    """What vLLM's CUDA platform would read from one GPU (see the module docstring for where each is read).

    :param name: the device name (``NVIDIA H200``).
    :param capability: compute capability ``(major, minor)``.
    :param num_compute_units: streaming multiprocessors (``multi_processor_count``).
    :param total_memory: device memory in bytes.
    :param supports_pdl: programmatic dependent launch (``is_arch_support_pdl``).
    :param fp8_dtype: the platform's FP8 dtype, one of :data:`FP8_DTYPES`.
    :param cuda_version: ``torch.version.cuda`` on the device.
    :param torch_version: torch's version on the device.
    :param device_count: GPUs visible on the host.
    :param triton_target: Triton's target for the device; its arch must match ``capability``.
    :param provenance: where the values come from (host, date, how read), for the pack's manifest.
    """

    name: str = attrs.field(validator=_check_name)
    capability: tuple[int, int] = attrs.field(converter=_capability, validator=_check_capability)
    num_compute_units: int = attrs.field(validator=_check_positive)
    total_memory: int = attrs.field(validator=_check_positive)
    supports_pdl: bool = attrs.field()
    fp8_dtype: str = attrs.field()
    cuda_version: str = attrs.field(validator=_check_version)
    torch_version: str = attrs.field(validator=_check_version)
    device_count: int = attrs.field(validator=_check_positive)
    triton_target: TritonTarget = attrs.field(converter=_triton_target)
    provenance: str = attrs.field(validator=_check_name)

    @supports_pdl.validator
    def _pdl(self, attribute: attrs.Attribute[bool], value: Any) -> None:
        _must("supports_pdl", isinstance(value, bool), "true or false", value)

    @fp8_dtype.validator
    def _fp8(self, attribute: attrs.Attribute[str], value: Any) -> None:
        _must("fp8_dtype", value in FP8_DTYPES, f"one of {', '.join(FP8_DTYPES)}", value)

    @triton_target.validator
    def _target(self, attribute: attrs.Attribute[TritonTarget], value: Any) -> None:
        _must("triton_target", isinstance(value, TritonTarget), "a TritonTarget or its JSON object", value)
        arch = self.capability[0] * 10 + self.capability[1]
        _must("triton_target.arch", value.arch == arch, f"{arch}, the capability's", value.arch)

    @property
    def arch(self) -> int:
        """The capability as one int (``90``), as vLLM's ``DeviceCapability.to_int`` and Triton write it."""
        return self.capability[0] * 10 + self.capability[1]

    def to_dict(self) -> dict[str, Any]:
        """The profile as JSON-ready values (the capability as a list)."""
        out = attrs.asdict(self)
        out["capability"] = list(self.capability)
        return out

    @classmethod
    def from_dict(cls, data: Any, *, source: str | None = None) -> GpuProfile:
        """Read a profile from :meth:`to_dict`'s form.

        :param source: the file it came from, named in errors.
        :raises ProfileError: for an unknown, missing or invalid field, naming it.
        """
        if not isinstance(data, dict):
            raise ProfileError("<profile>", f"must be a JSON object (got {type(data).__name__})", source=source)
        names = [a.name for a in attrs.fields(cls)]
        for key in data:
            if key not in names:
                raise ProfileError(str(key), f"is not a profile field (fields: {', '.join(names)})", source=source)
        for name in names:
            if name not in data:
                raise ProfileError(name, "is missing", source=source)
        try:
            return cls(**data)
        except ProfileError as e:
            raise ProfileError(e.field, e.problem, source=source) from None

    def to_json(self) -> str:
        """The profile as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, *, source: str | None = None) -> GpuProfile:
        """Read a profile from JSON text.

        :raises ProfileError: if the text is not JSON or a field is wrong.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError("<profile>", f"must be JSON (got a parse error: {e})", source=source) from None
        return cls.from_dict(data, source=source)

    @classmethod
    def load(cls, path: str | Path) -> GpuProfile:
        """Read a profile file.

        :raises ProfileError: if it is not a valid profile.
        """
        return cls.from_json(Path(path).read_text(), source=str(path))

    @classmethod
    def named(cls, name: str) -> GpuProfile:
        """A profile shipped with warmreg-vllm (``profiles/<name>.json``, e.g. ``h200``).

        :raises ProfileError: if no such profile is shipped.
        """
        folder = resources.files("warmreg_vllm") / "profiles"
        shipped = sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))
        if name not in shipped:
            raise ProfileError("<name>", f"must be one of {', '.join(shipped)} (got {name!r})")
        return cls.from_json((folder / f"{name}.json").read_text(), source=f"warmreg_vllm/profiles/{name}.json")
