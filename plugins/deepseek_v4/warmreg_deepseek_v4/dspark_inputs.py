"""The inputs of a DSpark draft step (vLLM 0.33 ``v1/worker/gpu/spec_decode/dflash/speculator.py``:
``_prepare_dflash_inputs_kernel`` through ``prepare_dflash_inputs``, which ``DFlashSpeculator.propose`` launches
once per draft KV-cache group; the DSpark speculator of ``v1/worker/gpu/spec_decode/dspark`` reuses it with
``sample_from_anchor``). In vLLM it is a plain ``@triton.jit`` that no warmup registers.

Grid ``(num_reqs, cdiv(max_q + Nq, B))`` with ``max_q`` the step's longest target query, ``Nq`` the query tokens
per request and ``B = min(256, next_pow2(max_q + Nq))``. For request ``r`` (target span ``[cs, ce)``, ``nrej``
rejected drafts, ``nv = ce - cs - nrej``, ``st = idx_mapping[r]``, ``lastp = target_positions[cs + nv - 1]``)::

    bonus = num_sampled[r] > 0 ? last_sampled[st] : next_prefill_tokens[st]      (chunked prefill: the next token)
    j < ce - cs (context rows):   pos = j < nv ? target_positions[cs + j] : 0
                                  ctx_pos[cs + j] = pos
                                  ctx_slot[cs + j] = j < nv and blk(pos) != 0 ? slot(pos) : PAD   (block 0: null block)
    nv <= j < nv + Nq (queries):  o = j - nv;  q = lastp + 1 + o;  i = r * Nq + o
                                  input_ids[i] = o == 0 ? bonus : noise_id;  is_padding[i] = False
                                  positions[i] = min(q, max_model_len - 1);  q_slot[i] = blk(q) != 0 ? slot(q) : PAD
                                  o >= off (off = 0 with SAMPLE_FROM_ANCHOR, else 1):  s = r * N + o - off
                                      sample_idx[s] = i;  sample_pos[s] = SAMPLE_FROM_ANCHOR ? q + 1 : q
                                      sample_idx_mapping[s] = st
    block 0:  query_start_loc[r] = r * Nq;  seq_lens[r] = min(lastp + 1 + Nq, max_model_len)
              temperature_out[st] = temperature[st];  seeds_out[st] = seeds[st]
    last request, block 0 (graph padding):  query_start_loc[R..max_reqs] = R * Nq;  seq_lens[R..max_reqs) = 0
              sample rows [R * N, max_reqs * N): idx 0, pos 0, mapping -1
              query rows [R * Nq, max_num_tokens): id 0, position 0, is_padding True, slot PAD

``blk(p) = block_table[r, min(p // (bs * CP), stride - 1)]`` and ``slot(p)`` is the rank-local slot
(``v1/worker/gpu/cp_utils.py``: ``cp_local_slot``): ``blk * bs + p % bs`` with ``CP == 1``; else, with
``o = p % (bs * CP)``, ``blk * bs + (o // (I * CP)) * I + o % I`` when ``(o // I) % CP == cp_rank``, else PAD.

Key: the constexprs (``SAMPLE_FROM_ANCHOR``, ``PAD_SLOT_ID``, ``CP_SIZE``, ``CP_INTERLEAVE`` and ``BLOCK_SIZE``,
one of 8..256 for DSpark's ``Nq = 5``), ``num_warps``, and the class of each of the nine ints, which the kernel
specializes as vLLM's does (no ``do_not_specialize``): the table's row stride, the noise id, the KV block size,
``Nq``, ``N``, ``max_num_reqs``, ``max_num_tokens``, ``max_model_len`` and ``cp_rank``. Pointers are not
specialized on alignment (see :mod:`warmreg_deepseek_v4.metadata`). Runtime-bound loops are ``while`` loops (see
:mod:`.sparse_mla`). The PyTorch reference is :mod:`.dspark_inputs_reference`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
import triton
import triton.language as tl

import warmreg
from warmreg.ops import block_table_width

from ._serving import dcp_world_size, max_model_len, serving_int
from .dspark import DSparkDraft
from .dspark_buffers import DTYPES, DraftInputs, sizes
from .model import DSV4

__all__ = [
    "PAD_SLOT_ID",
    "DSparkInputs",
    "DraftInputs",
    "PrepareDSparkInputsKey",
    "register",
]

PAD_SLOT_ID = -1  # vLLM's v1/attention/backends/utils.py PAD_SLOT_ID
MAX_BLOCK = 256  # prepare_dflash_inputs caps BLOCK_SIZE here
_POINTERS = [
    "out_input_ids_ptr", "out_positions_ptr", "out_is_padding_ptr", "out_query_start_loc_ptr", "out_seq_lens_ptr",
    "out_query_slot_ptr", "out_context_positions_ptr", "out_context_slot_ptr", "out_sample_indices_ptr",
    "out_sample_pos_ptr", "out_sample_idx_mapping_ptr", "out_temperature_ptr", "out_seeds_ptr",
    "target_positions_ptr", "target_query_start_loc_ptr", "idx_mapping_ptr", "last_sampled_ptr",
    "next_prefill_tokens_ptr", "num_sampled_ptr", "num_rejected_ptr", "temperature_ptr", "seeds_ptr",
    "block_table_ptr",
]  # fmt: skip


@triton.jit
def _local_slot(pos, block, block_size, cp_rank, CP_SIZE: tl.constexpr, CP_INTERLEAVE: tl.constexpr, PAD: tl.constexpr):
    """The rank-local slot of ``pos`` in ``block``, PAD for a position another DCP rank holds."""
    off = pos % (block_size * CP_SIZE)
    if CP_SIZE == 1:
        return block * block_size + off
    mine = (off // CP_INTERLEAVE) % CP_SIZE == cp_rank
    local = (off // (CP_INTERLEAVE * CP_SIZE)) * CP_INTERLEAVE + off % CP_INTERLEAVE
    return tl.where(mine, block * block_size + local, PAD)


@triton.jit
def _fill(ptr, start, stop, value, BLOCK_SIZE: tl.constexpr):
    """``ptr[start:stop] = value`` (a graph-padding tail)."""
    i = start
    while i < stop:
        offs = i + tl.arange(0, BLOCK_SIZE)
        tl.store(ptr + offs, (tl.zeros([BLOCK_SIZE], tl.int64) + value).to(ptr.dtype.element_ty), mask=offs < stop)
        i += BLOCK_SIZE


@triton.jit(do_not_specialize_on_alignment=_POINTERS)
def _prepare_dspark_inputs_kernel(
    out_input_ids_ptr,
    out_positions_ptr,
    out_is_padding_ptr,
    out_query_start_loc_ptr,
    out_seq_lens_ptr,
    out_query_slot_ptr,
    out_context_positions_ptr,
    out_context_slot_ptr,
    out_sample_indices_ptr,
    out_sample_pos_ptr,
    out_sample_idx_mapping_ptr,
    out_temperature_ptr,
    out_seeds_ptr,
    target_positions_ptr,
    target_query_start_loc_ptr,
    idx_mapping_ptr,
    last_sampled_ptr,
    next_prefill_tokens_ptr,
    num_sampled_ptr,
    num_rejected_ptr,
    temperature_ptr,
    seeds_ptr,
    block_table_ptr,
    block_table_stride,
    parallel_drafting_token_id,
    block_size,
    num_query_per_req,
    num_speculative_steps,
    max_num_reqs,
    max_num_tokens,
    max_model_len,
    cp_rank,
    SAMPLE_FROM_ANCHOR: tl.constexpr,  # DSpark: every query slot predicts the next token (anchor included)
    PAD_SLOT_ID: tl.constexpr,  # the slot of a row that writes no KV (-1)
    CP_SIZE: tl.constexpr,  # decode-context-parallel ranks (1 = off)
    CP_INTERLEAVE: tl.constexpr,  # tokens dealt to one DCP rank at a time
    BLOCK_SIZE: tl.constexpr,  # rows of a request's span per program: min(256, next_pow2(max_q + Nq))
):
    req = tl.program_id(0)
    blk_idx = tl.program_id(1)
    num_reqs = tl.num_programs(0)
    state = tl.load(idx_mapping_ptr + req)
    cs = tl.load(target_query_start_loc_ptr + req)
    ce = tl.load(target_query_start_loc_ptr + req + 1)
    nv = ce - cs - tl.load(num_rejected_ptr + req)
    if tl.load(num_sampled_ptr + req) > 0:
        bonus = tl.load(last_sampled_ptr + state).to(tl.int32)
    else:
        bonus = tl.load(next_prefill_tokens_ptr + state).to(tl.int32)
    lastp = tl.load(target_positions_ptr + cs + nv - 1)
    bt_row = block_table_ptr + req.to(tl.int64) * block_table_stride
    j = blk_idx * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    # context rows: the whole span is written, rejected rows as position 0 / PAD
    is_ctx, live = j < ce - cs, j < nv
    pos = tl.load(target_positions_ptr + cs + tl.where(is_ctx, j, 0), mask=live, other=0)
    blk = tl.load(bt_row + tl.minimum(pos // (block_size * CP_SIZE), block_table_stride - 1), mask=live, other=0)
    blk = blk.to(tl.int64)
    slot = _local_slot(pos, blk, block_size, cp_rank, CP_SIZE, CP_INTERLEAVE, PAD_SLOT_ID)
    tl.store(out_context_positions_ptr + cs + j, pos, mask=is_ctx)
    tl.store(out_context_slot_ptr + cs + j, tl.where(live & (blk != 0), slot, PAD_SLOT_ID), mask=is_ctx)
    # query rows
    o = j - nv
    is_q = (j >= nv) & (o < num_query_per_req)
    qpos = lastp + 1 + o
    qi = req * num_query_per_req + o
    qblk = tl.load(bt_row + tl.minimum(qpos // (block_size * CP_SIZE), block_table_stride - 1), mask=is_q, other=0)
    qblk = qblk.to(tl.int64)
    qslot = _local_slot(qpos, qblk, block_size, cp_rank, CP_SIZE, CP_INTERLEAVE, PAD_SLOT_ID)
    tl.store(out_input_ids_ptr + qi, tl.where(o == 0, bonus, parallel_drafting_token_id), mask=is_q)
    tl.store(out_is_padding_ptr + qi, tl.zeros([BLOCK_SIZE], tl.int1), mask=is_q)
    tl.store(out_positions_ptr + qi, tl.minimum(qpos, max_model_len - 1), mask=is_q)
    tl.store(out_query_slot_ptr + qi, tl.where(qblk != 0, qslot, PAD_SLOT_ID), mask=is_q)
    off = 0 if SAMPLE_FROM_ANCHOR else 1
    si = req * num_speculative_steps + o - off
    is_s = is_q & (o >= off)
    tl.store(out_sample_indices_ptr + si, qi, mask=is_s)
    tl.store(out_sample_pos_ptr + si, qpos + (1 - off), mask=is_s)  # anchor-first: each slot predicts the next
    tl.store(out_sample_idx_mapping_ptr + si, tl.zeros([BLOCK_SIZE], tl.int64) + state, mask=is_s)
    if blk_idx == 0:
        tl.store(out_query_start_loc_ptr + req, req * num_query_per_req)
        tl.store(out_seq_lens_ptr + req, tl.minimum(lastp + 1 + num_query_per_req, max_model_len))
        tl.store(out_temperature_ptr + state, tl.load(temperature_ptr + state))
        tl.store(out_seeds_ptr + state, tl.load(seeds_ptr + state))
        if req == num_reqs - 1:  # pad the per-request and per-token buffers for graph replays of more requests
            _fill(out_query_start_loc_ptr, num_reqs, max_num_reqs + 1, num_reqs * num_query_per_req, BLOCK_SIZE)
            _fill(out_seq_lens_ptr, num_reqs, max_num_reqs, 0, BLOCK_SIZE)
            s0, s1 = num_reqs * num_speculative_steps, max_num_reqs * num_speculative_steps
            _fill(out_sample_indices_ptr, s0, s1, 0, BLOCK_SIZE)
            _fill(out_sample_pos_ptr, s0, s1, 0, BLOCK_SIZE)
            _fill(out_sample_idx_mapping_ptr, s0, s1, -1, BLOCK_SIZE)
            q0 = num_reqs * num_query_per_req
            _fill(out_input_ids_ptr, q0, max_num_tokens, 0, BLOCK_SIZE)
            _fill(out_positions_ptr, q0, max_num_tokens, 0, BLOCK_SIZE)
            _fill(out_is_padding_ptr, q0, max_num_tokens, 1, BLOCK_SIZE)
            _fill(out_query_slot_ptr, q0, max_num_tokens, PAD_SLOT_ID, BLOCK_SIZE)


_INPUTS = {
    "target_positions": torch.int64, "target_query_start_loc": torch.int32, "idx_mapping": torch.int64,
    "last_sampled": torch.int64, "next_prefill_tokens": torch.int32, "num_sampled": torch.int32,
    "num_rejected": torch.int32, "temperature": torch.float32, "seeds": torch.int64,
}  # fmt: skip


@attrs.frozen(kw_only=True)
class PrepareDSparkInputsKey(warmreg.CompileKey):
    """What changes the binary: the constexprs, ``num_warps`` and the classes of the specialized ints."""

    sample_from_anchor: bool
    pad_slot_id: int
    cp_size: int
    cp_interleave: int
    block: int  # BLOCK_SIZE
    block_table_stride: str
    noise_token_id: str
    kv_block_size: str
    num_query_per_req: str
    num_speculative_steps: str
    max_num_reqs: str
    max_num_tokens: str
    max_model_len: str
    cp_rank: str
    num_warps: int


def step_block(max_query_len: int, num_query_per_req: int) -> int:
    """``BLOCK_SIZE = min(256, next_pow2(max(1, max_q + Nq)))`` (``prepare_dflash_inputs``)."""
    return min(MAX_BLOCK, warmreg.next_pow2(max(1, max_query_len + num_query_per_req)))


class DSparkInputs(warmreg.TritonKernel[PrepareDSparkInputsKey]):
    """The inputs of a DSpark draft step, for one draft KV-cache group (see the module docstring).

    :param draft: the deployment's draft sizes (domains only; launches take every value as an argument).
    """

    name = "deepseek_v4.prepare_dspark_inputs"
    key_type = PrepareDSparkInputsKey
    jit = _prepare_dspark_inputs_kernel

    def __init__(self, *, draft: DSparkDraft | None = None) -> None:
        self.draft = draft

    def dispatch(
        self, *, max_query_len: int, block_table: torch.Tensor, parallel_drafting_token_id: int, block_size: int,
        num_query_per_req: int, num_speculative_steps: int, max_num_reqs: int, max_num_tokens: int,
        max_model_len: int, cp_rank: int, cp_size: int, cp_interleave: int, sample_from_anchor: bool,
    ) -> PrepareDSparkInputsKey:  # fmt: skip
        ic = warmreg.int_class
        return PrepareDSparkInputsKey(
            sample_from_anchor=sample_from_anchor, pad_slot_id=PAD_SLOT_ID, cp_size=cp_size,
            cp_interleave=cp_interleave, block=step_block(max_query_len, num_query_per_req),
            block_table_stride=ic(block_table.stride(0)), noise_token_id=ic(parallel_drafting_token_id),
            kv_block_size=ic(block_size), num_query_per_req=ic(num_query_per_req),
            num_speculative_steps=ic(num_speculative_steps), max_num_reqs=ic(max_num_reqs),
            max_num_tokens=ic(max_num_tokens), max_model_len=ic(max_model_len), cp_rank=ic(cp_rank), num_warps=4,
        )  # fmt: skip

    def domains(self, config: warmreg.WarmConfig, platform: warmreg.Platform) -> Mapping[str, Iterable[Any]]:
        if self.draft is None:
            raise warmreg.KernelContractError(
                self.name, "domains need the deployment's DSpark draft", fix="pass draft="
            )
        d, mml = self.draft, max_model_len(config)
        model = DSV4.from_config(config)
        dcp = dcp_world_size(config, model)
        interleave = serving_int(config, "cp_kv_cache_interleave_size", 1) if dcp > 1 else 1
        tokens, nq = serving_int(config, "max_num_batched_tokens"), d.num_query_per_req
        # one longest target query per BLOCK_SIZE: 1, the budget, and each q with q + Nq a power of two
        top = warmreg.next_pow2(tokens + nq)
        queries = sorted({1, tokens} | {p - nq for p in warmreg.powers_of_two(1, top) if 1 <= p - nq <= tokens})
        # the SWA group's persistent table (the speculator shares the target's block tables; V4.1's pages are 32)
        width = block_table_width(mml, d.swa_block_size, dcp)
        return {
            "max_query_len": queries, "block_table": [warmreg.meta((1, width), torch.int32)],
            "parallel_drafting_token_id": [d.noise_token_id], "block_size": [d.swa_block_size],
            "num_query_per_req": [nq], "num_speculative_steps": [d.num_tokens],
            "max_num_reqs": [serving_int(config, "max_num_seqs")], "max_num_tokens": [tokens], "max_model_len": [mml],
            "cp_rank": range(dcp), "cp_size": [dcp], "cp_interleave": [interleave],
            "sample_from_anchor": [d.sample_from_anchor],
        }  # fmt: skip

    def warmup_inputs(self, key: PrepareDSparkInputsKey) -> Mapping[str, Any]:
        rep = warmreg.int_class_rep
        meta = {n: warmreg.meta((2,), dt) for n, dt in _INPUTS.items()}
        nq, steps = _query_reps(key)
        reqs, tokens = rep(key.max_num_reqs), rep(key.max_num_tokens)
        out = DraftInputs(
            *(warmreg.meta((n,), DTYPES[f]) for f, n in zip(DraftInputs._fields, sizes(reqs, tokens, steps)))
        )
        # max_q with the key's BLOCK_SIZE: B = next_pow2(max_q + Nq), or any max_q >= 256 - Nq for 256
        return {
            **meta, "block_table": warmreg.meta((1, rep(key.block_table_stride)), torch.int32),
            "max_query_len": max(1, key.block - nq), "block_size": rep(key.kv_block_size),
            "parallel_drafting_token_id": rep(key.noise_token_id), "num_query_per_req": nq,
            "num_speculative_steps": steps, "max_num_reqs": reqs, "max_num_tokens": tokens,
            "max_model_len": rep(key.max_model_len), "cp_rank": _rank_of(key.cp_rank, key.cp_size),
            "cp_size": key.cp_size, "cp_interleave": key.cp_interleave, "sample_from_anchor": key.sample_from_anchor,
            "out": out, "num_reqs": 1,
        }  # fmt: skip

    @warmreg.kernel_launcher
    def __call__(
        self,
        target_positions: torch.Tensor,
        target_query_start_loc: torch.Tensor,
        idx_mapping: torch.Tensor,
        last_sampled: torch.Tensor,
        next_prefill_tokens: torch.Tensor,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        block_table: torch.Tensor,
        *,
        num_reqs: int,
        max_query_len: int,
        block_size: int,
        parallel_drafting_token_id: int,
        num_query_per_req: int,
        num_speculative_steps: int,
        max_num_reqs: int,
        max_num_tokens: int,
        max_model_len: int,
        cp_rank: int = 0,
        cp_size: int = 1,
        cp_interleave: int = 1,
        sample_from_anchor: bool = True,
        out: DraftInputs | None = None,
    ) -> warmreg.LaunchSpec[PrepareDSparkInputsKey]:
        """Write the draft inputs of ``num_reqs`` requests into ``out`` (fresh :meth:`DraftInputs.zeros` if None); returns it.

        :param target_positions: int64 ``[>= target tokens]``; ``target_query_start_loc`` int32 ``[>= num_reqs + 1]``.
        :param idx_mapping: int64 ``[>= num_reqs]`` batch -> request-state index; ``last_sampled`` int64 and
            ``next_prefill_tokens`` int32 (row 0 of the lookahead table), ``temperature`` float32 and ``seeds``
            int64, each indexed by state; ``num_sampled`` / ``num_rejected`` int32 ``[>= num_reqs]``.
        :param block_table: int32 ``[>= num_reqs, *]`` the group's table, contiguous rows (row stride passed).
        :param max_query_len: the longest target query of the first ``num_reqs`` requests (host int: picks BLOCK_SIZE).
        :param block_size: the group's KV block size; ``num_query_per_req`` ``Nq``, ``num_speculative_steps`` ``N``.
        :raises warmreg.LaunchError: for wrong dtypes, sizes, or a DCP rank / interleave that does not fit.
        """
        self._check(locals())
        if out is None:
            out = DraftInputs.zeros(max_num_reqs, max_num_tokens, num_speculative_steps, target_positions.device)
        self._check_out(out, max_num_reqs, max_num_tokens, num_speculative_steps)
        key = self.dispatch(
            max_query_len=max_query_len, block_table=block_table, parallel_drafting_token_id=parallel_drafting_token_id,
            block_size=block_size, num_query_per_req=num_query_per_req, num_speculative_steps=num_speculative_steps,
            max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, max_model_len=max_model_len, cp_rank=cp_rank,
            cp_size=cp_size, cp_interleave=cp_interleave, sample_from_anchor=sample_from_anchor,
        )  # fmt: skip
        kwargs: dict[str, Any] = {f"out_{n}_ptr": t for n, t in zip(_OUT_ARGS, out)}
        kwargs.update({f"{n}_ptr": t for n, t in zip(_INPUTS, (target_positions, target_query_start_loc, idx_mapping,
                       last_sampled, next_prefill_tokens, num_sampled, num_rejected, temperature, seeds))})  # fmt: skip
        kwargs.update(
            block_table_ptr=block_table, block_table_stride=block_table.stride(0),
            parallel_drafting_token_id=parallel_drafting_token_id, block_size=block_size,
            num_query_per_req=num_query_per_req, num_speculative_steps=num_speculative_steps,
            max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens, max_model_len=max_model_len, cp_rank=cp_rank,
            SAMPLE_FROM_ANCHOR=key.sample_from_anchor, PAD_SLOT_ID=key.pad_slot_id, CP_SIZE=key.cp_size,
            CP_INTERLEAVE=key.cp_interleave, BLOCK_SIZE=key.block,
        )  # fmt: skip
        grid = (num_reqs, triton.cdiv(max(1, max_query_len + num_query_per_req), key.block))
        return warmreg.LaunchSpec(key, grid, kwargs, out)

    def _check(self, args: Mapping[str, Any]) -> None:
        for n, dtype in _INPUTS.items():
            t = args[n]
            if t.dtype != dtype or t.ndim < 1 or (t.shape[-1] > 1 and t.stride(-1) != 1):
                raise warmreg.LaunchError(
                    self.name, f"{n} must be a contiguous {dtype} tensor (got {t.dtype} {tuple(t.shape)})"
                )
        r, bt = args["num_reqs"], args["block_table"]
        if not 1 <= r <= args["max_num_reqs"] or args["target_query_start_loc"].shape[0] < r + 1:
            raise warmreg.LaunchError(
                self.name, f"num_reqs={r} must be in 1..max_num_reqs with query_start_loc [>= {r + 1}]"
            )
        if bt.dtype != torch.int32 or bt.ndim != 2 or bt.shape[0] < r or (bt.shape[1] > 1 and bt.stride(1) != 1):
            raise warmreg.LaunchError(self.name, f"block_table must be int32 [>= {r}, W] with contiguous rows")
        cp, rank, inter = args["cp_size"], args["cp_rank"], args["cp_interleave"]
        if cp < 1 or not 0 <= rank < cp or inter < 1 or (cp > 1 and args["block_size"] % inter):
            raise warmreg.LaunchError(self.name, f"bad DCP: size {cp}, rank {rank}, interleave {inter}")
        if min(args["max_query_len"], args["num_speculative_steps"], args["block_size"], args["max_model_len"]) < 1:
            raise warmreg.LaunchError(
                self.name, "max_query_len, num_speculative_steps, block_size and max_model_len must be >= 1"
            )
        nq = args["num_query_per_req"]
        if nq != args["num_speculative_steps"] + (not args["sample_from_anchor"]):
            raise warmreg.LaunchError(self.name, f"num_query_per_req={nq} must be N (sample_from_anchor) or 1 + N")

    def _check_out(self, out: DraftInputs, reqs: int, tokens: int, steps: int) -> None:
        for (name, t), n in zip(out._asdict().items(), sizes(reqs, tokens, steps)):
            if t.dtype != DTYPES[name] or t.ndim != 1 or t.shape[0] < n or (n > 1 and t.stride(0) != 1):
                raise warmreg.LaunchError(self.name, f"out.{name} must be a contiguous {DTYPES[name]} [>= {n}]")


_OUT_ARGS = (
    "input_ids", "positions", "is_padding", "query_start_loc", "seq_lens", "query_slot", "context_positions",
    "context_slot", "sample_indices", "sample_pos", "sample_idx_mapping", "temperature", "seeds",
)  # fmt: skip


def _query_reps(key: PrepareDSparkInputsKey) -> tuple[int, int]:
    """The smallest ``(Nq, N)`` of the key's classes (``Nq = N`` anchor-first, else ``1 + N``): the smallest ``Nq``
    reaches every BLOCK_SIZE the deployment's can, ``next_pow2(max_q + Nq)`` being monotone in ``Nq``."""
    extra = 0 if key.sample_from_anchor else 1
    ic = warmreg.int_class
    for nq in range(1 + extra, 1 << 16):
        if ic(nq) == key.num_query_per_req and ic(nq - extra) == key.num_speculative_steps:
            return nq, nq - extra
    raise warmreg.CompileKeyError(str(key), "has no Nq, N of its classes", fix="build keys with dispatch()")


def _rank_of(cls: str, cp_size: int) -> int:
    """The lowest DCP rank of the int class ``cls`` (rank 0 is ``div16``)."""
    return next(r for r in range(cp_size) if warmreg.int_class(r) == cls)


def register(registry: warmreg.Registry, model: DSV4, config: warmreg.WarmConfig, platform: warmreg.Platform) -> None:
    """Register the draft-input preparation with DSpark on (every platform: the V2 model runner's speculator is
    platform-independent Triton), one draft KV-cache group (the SWA-only draft layers' pages:
    :attr:`.dspark.DSparkDraft.swa_block_size`, 64 tokens for DeepSeek-V4, 32 for V4.1, on CUDA and ROCm alike).

    :raises warmreg.ConfigError: for an unknown ``speculative_method``, DSpark fields that do not fit, or DCP
        with C4 layers (the DeepSeek-V4 indexer does not support it).
    """
    draft = DSparkDraft.from_config(config, model)
    if draft is not None:
        dcp_world_size(config, model)
        registry.add(DSparkInputs(draft=draft))
