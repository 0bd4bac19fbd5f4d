"""One rank of a vLLM deployment, built on the meta device in this process, for registration only.

:func:`meta_rank` lets vLLM's own model construction (``initialize_model``), attention-backend set-up and KV-cache
allocation run on a machine without a GPU, inside :func:`~warmreg_vllm.emulation.emulate_gpu`, as rank 0 of the
deployment's tensor-parallel group. Nothing runs a kernel and no weight is loaded. Each stand-in, and the vLLM file
whose need it meets (vLLM 0.33.0 and 0.34.0), undone on exit:

1. **The process groups** (``vllm/distributed/parallel_state.py``): torch's ``fake`` backend stands for NCCL and
   gloo (``init_process_group`` and every ``new_group``), so ``get_tp_group().world_size`` is the deployment's;
   ``init_model_parallel_group`` is called without the shared-memory broadcaster, which waits for the other ranks.
2. **CUDA tensors are meta tensors**: a torch function mode moves every ``device="cuda"`` factory call,
   ``.cuda()`` and ``.to("cuda")`` to the meta device (layers, metadata builders and the KV cache name the device);
   not under torch's ``FakeTensorMode``, whose CUDA tensors need no device and are what vLLM's key derivation falls
   back to for a dispatch that asserts ``is_cuda`` (``model_executor/warmup/jit_warmup_triton_helper.py``,
   ``_DecoratedTritonJitKernel.get_warmup_keys``; vLLM 0.34's ``scatter_states``, which Kimi-K3's KDA layers register).
3. **Streams and events are inert**: ``torch.cuda.Stream`` and ``torch.cuda.Event`` (the DeepSeek-V4 model's
   auxiliary streams, ``models/deepseek_v4/nvidia/model.py``) need a driver.
4. **Activation ops the layers bind at construction** (``model_executor/layers/activation.py``: ``self.op =
   torch.ops._C.<op>`` on CUDA) are defined without an implementation while absent: vLLM's CUDA extension that
   registers them needs ``libcuda``. They are never called here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .emulation import EmulationError

__all__ = ["BOUND_C_OPS", "meta_rank"]

#: ``torch.ops._C`` activation ops vLLM's layers bind in ``__init__`` on CUDA (point 4), with a placeholder schema.
BOUND_C_OPS = ("silu_and_mul", "silu_and_mul_with_clamp", "mul_and_silu", "gelu_and_mul", "gelu_tanh_and_mul")


class _Inert:
    """A stream or event that is never used on this machine."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


class _CudaIsMeta(TorchFunctionMode):
    """Torch function mode that places every CUDA tensor on the meta device (point 2)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            return func(*args, **kwargs)  # a fake CUDA tensor allocates nothing and answers is_cuda as on the GPU
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "meta"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("meta" if isinstance(a, (str, torch.device)) and _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _fake_process_groups(vllm_config: Any) -> Iterator[None]:
    import torch.distributed as dist
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    if dist.is_initialized():
        raise EmulationError(
            "torch.distributed is already initialized in this process",
            fix="compute registrations in a fresh process (one deployment per process)",
        )
    parallel = vllm_config.parallel_config
    new_group, init_group = dist.new_group, parallel_state.init_model_parallel_group

    def fake_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") in (None, "gloo", "nccl"):
            kwargs["backend"] = "fake"
        return new_group(*args, **kwargs)

    def group_without_broadcaster(*args: Any, use_message_queue_broadcaster: bool = False, **kwargs: Any) -> Any:
        return init_group(*args, use_message_queue_broadcaster=False, **kwargs)

    dist.new_group = fake_group
    parallel_state.init_model_parallel_group = group_without_broadcaster
    try:
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=parallel.world_size)
        with set_current_vllm_config(vllm_config):
            parallel_state.init_distributed_environment(
                world_size=parallel.world_size, rank=0, local_rank=0, backend="fake"
            )
            parallel_state.ensure_model_parallel_initialized(
                parallel.tensor_parallel_size, parallel.pipeline_parallel_size
            )
        yield
    finally:
        dist.new_group, parallel_state.init_model_parallel_group = new_group, init_group
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


@contextlib.contextmanager
def _bound_c_ops() -> Iterator[None]:
    absent = [name for name in BOUND_C_OPS if not hasattr(torch.ops._C, name)]
    if not absent:
        yield
        return
    library = torch.library.Library("_C", "FRAGMENT")
    for name in absent:
        library.define(f"{name}(Tensor[] args) -> ()")
    try:
        yield
    finally:
        library._destroy()


@contextlib.contextmanager
def meta_rank(vllm_config: Any) -> Iterator[None]:
    """Run the block as rank 0 of ``vllm_config``'s deployment, with CUDA tensors on the meta device.

    Enter inside :func:`~warmreg_vllm.emulation.emulate_gpu` (the config must be the GPU's). The block also holds
    ``set_current_vllm_config`` and the model's default dtype, as vLLM's model loader does.

    :raises EmulationError: if ``torch.distributed`` is already initialized in this process.
    """
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    streams = torch.cuda.Stream, torch.cuda.Event
    with contextlib.ExitStack() as stack:
        stack.enter_context(_fake_process_groups(vllm_config))
        stack.enter_context(_bound_c_ops())
        torch.cuda.Stream, torch.cuda.Event = _Inert, _Inert  # type: ignore[misc, assignment]
        stack.callback(setattr, torch.cuda, "Stream", streams[0])
        stack.callback(setattr, torch.cuda, "Event", streams[1])
        stack.enter_context(set_current_vllm_config(vllm_config))
        stack.enter_context(set_default_torch_dtype(vllm_config.model_config.dtype))
        stack.enter_context(torch.device("meta"))
        stack.enter_context(_CudaIsMeta())
        yield
