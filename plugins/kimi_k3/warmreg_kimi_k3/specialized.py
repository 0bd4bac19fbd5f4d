"""The settings that switch vLLM 0.34's Kimi-K3 specialized decode on, and what its Triton kernels are sized by.

vLLM builds the specialized decode (a CuTe decode executor over the stock backbone) when
``additional_config={"decode_backend": "latency_specialized"}`` (``models/kimi_k3/nvidia/specialized_decode/runtime/
__init__.py: specialized_decode_config``; ``auto``, the default, keeps the stock decode, any other value is refused).
It refuses every GPU but the SM100 family (``is_device_capability_family(100)``: sm_100 and sm_103), so the kernels
of this module's users are planned on ``cuda:100`` / ``cuda:103`` only. With a speculative config it must be DSpark,
and vLLM then builds the DSpark drafter as ``SpecializedK3DSparkForCausalLM`` (``drafter/model.py``), whose Markov
sampling (``drafter/markov.py``) and draft attention (``drafter/attention.py``) launch the ops of
``warmreg_kimi_k3.markov_*`` and ``warmreg_kimi_k3.draft_fold``.

Settings (canonical names; the engine reader maps the first two from vLLM's ``additional_config.decode_backend``
and ``speculative_config.draft_sample_method``):

- ``serving.decode_backend``: ``auto`` (default) or ``latency_specialized`` (``additional_config.decode_backend``).
- ``serving.draft_sample_method``: ``greedy`` (vLLM's default) or ``probabilistic``
  (``speculative_config.draft_sample_method``). The fused Markov sampling runs only for probabilistic drafts
  (``markov.why_not``: "greedy drafts" otherwise).
- ``serving.dspark_markov_rank``: the DSpark draft checkpoint's ``markov_rank`` (default 256, the rank vLLM's
  ``markov.py`` documents for Kimi-K3: ``markov_w2`` 163840 x 256). It lives in the draft model's config, which
  warmreg does not read; it is a constexpr of the Markov step.
- ``serving.draft_num_attention_heads``: the DSpark draft's attention heads over all ranks (default: the target's
  ``text.num_attention_heads``); sizes the draft attention's fold.
"""

from __future__ import annotations

import attrs

import warmreg

from .model import PLUGIN, positive, positive_text_int, tensor_parallel_size

__all__ = [
    "SM100_FAMILY",
    "DSparkDraft",
    "decode_context_parallel_size",
    "dspark_draft",
    "specialized_decode",
]

#: vLLM's ``is_device_capability_family(100)``: sm_100 and sm_103 (sm_110 is another family).
SM100_FAMILY = warmreg.is_cuda & warmreg.sm_at_least(100) & warmreg.sm_below(110)
_BACKENDS = ("auto", "latency_specialized")
_SAMPLE_METHODS = ("greedy", "probabilistic")


def specialized_decode(config: warmreg.WarmConfig) -> bool:
    """Whether ``serving.decode_backend`` selects the specialized decode.

    :raises warmreg.ConfigError: for a value vLLM refuses.
    """
    backend = config.get("serving.decode_backend", str, plugin=PLUGIN, default="auto", choices=_BACKENDS)
    return backend == "latency_specialized"


def decode_context_parallel_size(config: warmreg.WarmConfig) -> int:
    """``serving.decode_context_parallel_size`` (default 1)."""
    return config.get("serving.decode_context_parallel_size", int, plugin=PLUGIN, default=1, check=positive)


@attrs.frozen(kw_only=True)
class DSparkDraft:
    """The specialized DSpark drafter of a deployment: what its Triton kernels are sized by.

    :param num_speculative_tokens: ``k``, the draft steps (and query tokens of a draft block).
    :param max_num_seqs: the most requests of a step.
    :param vocab_size: the draft vocabulary (the target's: a reduced one takes vLLM's loop).
    :param markov_rank: the Markov head's rank.
    :param probabilistic: probabilistic drafts (the fused Markov sampling runs only for them).
    :param heads: the draft attention's heads over all ranks.
    :param dcp: decode context parallel size (DCP = TP under the specialized decode, or 1).
    :param dtype: the draft logits' dtype (vLLM: ``model_config.head_dtype``, the model dtype).
    """

    num_speculative_tokens: int
    max_num_seqs: int
    vocab_size: int
    markov_rank: int
    probabilistic: bool
    heads: int
    dcp: int
    dtype: str


def dspark_draft(config: warmreg.WarmConfig) -> DSparkDraft | None:
    """The specialized DSpark drafter, or None where vLLM builds none: the stock decode, no speculative tokens or
    another speculative method (which the specialized decode refuses).

    :raises warmreg.ConfigError: for malformed settings, or a missing ``text.vocab_size`` when it drafts.
    """
    if not specialized_decode(config):
        return None
    drafts = config.get("serving.num_speculative_tokens", int, plugin=PLUGIN, default=0)
    method = config.get("serving.speculative_method", str, plugin=PLUGIN, default=None)
    if drafts <= 0 or method != "dspark":
        return None
    sample = config.get("serving.draft_sample_method", str, plugin=PLUGIN, default="greedy", choices=_SAMPLE_METHODS)
    heads = config.get("serving.draft_num_attention_heads", int, plugin=PLUGIN, default=None, check=positive)
    return DSparkDraft(
        num_speculative_tokens=drafts,
        max_num_seqs=config.get("serving.max_num_seqs", int, plugin=PLUGIN, check=positive),
        vocab_size=positive_text_int(config, "vocab_size"),
        markov_rank=config.get("serving.dspark_markov_rank", int, plugin=PLUGIN, default=256, check=positive),
        probabilistic=sample == "probabilistic",
        heads=heads if heads is not None else positive_text_int(config, "num_attention_heads"),
        dcp=decode_context_parallel_size(config) if tensor_parallel_size(config) > 1 else 1,
        dtype=config.get("serving.dtype", str, plugin=PLUGIN, default="bfloat16"),
    )
