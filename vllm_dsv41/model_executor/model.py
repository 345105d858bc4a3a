"""DeepSeek-V4.1-Flash as a vLLM model (CPU and CUDA; plain PyTorch or the ``torch.ops.dsv41`` ops).

Owns ``DeepseekV41ForCausalLM``: the same math as ``reference/model.py``
(architecture.md §2), organised as modules whose parameter names are the
checkpoint's own (``layers.L.attn.wq_a.weight`` …), so ``load_weights`` is a
short loop that dequantises FP8 32x32 / MXFP4 / FP8-row tensors on arrival.
KV state lives in engine-allocated paged caches (``vllm_dsv41.attention``):
the SWA ring of every layer (MXFP8 records), the compressed KV and index K of
the KV-source layers (NVFP4 / MXFP4 records) and the ratio-2 compressor ring.

Per step the model reads one :class:`~vllm_dsv41.attention.step.Step`
(requests, positions, block tables, replay starts, Engram lookback ids).  Rows
are flattened over requests for the projections, mHC and MoE; the plain path attends per
request over gathered, decoded records.  Decoder-side pruning (§3.2) goes
through :func:`decoder_rows`, the one place a graph split can hook: with ``VLLM_DSV41_PREFILL_GRAPHS`` the
decoder layers of a pruned step run there as a captured graph (``graphs.DecoderGraphs``).

Two paths, one switch (``VLLM_DSV41_OPS``, see :func:`ops_mode`): the plain-PyTorch path (per-request
attention over gathered, decoded records; the reference's helpers) and the ops path (whole-batch slot
lists into ``sparse_attn``, ``index_scores`` + ``candidate_blocks`` / ``topk_select`` for the indexer,
``compress_insert`` for the compressor, ``router`` for the gate, ``mhc_pre`` / ``mhc_post_pre`` /
``mhc_post`` for the boundaries).  On CPU the ops run their references and the two paths give the same
bits.  Every tensor is created on the activations' device; the step metadata is moved there once per
step (:class:`Step`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from vllm_dsv41 import engram as engram_math
from vllm_dsv41 import formats
from vllm_dsv41.attention import caches
from vllm_dsv41.attention.specs import COMPRESSED_BLOCK_SIZE
from vllm_dsv41.attention.backend import current_step, history_capacity, host_to_device
from vllm_dsv41.model_executor.linear import (FUSED_QUANT_MAX_ROWS, Dense, Expert, QuantLinear, WeightFormat,
                                              bf16_moe, env_count, fp8_moe,
                                              fp8_row_exponents, fuse_rows_on_cuda, fused_act_quant, fused_quant,
                                              fused_rms_norm, fused_rms_norm_quant, log_moe_choice, loop_moe,
                                              marlin_expert_stack, marlin_moe,
                                              masked_moe, moe_backend, moe_bf16_from, moe_fp8_from, moe_gemv_rows,
                                              mxfp4_expert_stack,
                                              ogs_expert_stack, ogs_moe, on_fast_device, QuantRows,
                                              reads_quantised_rows, resolve_moe_backend)
from vllm_dsv41.model_executor.graphs import (DecodeGraphs, DecoderGraphs, MixedGraphs, graph_mode, in_static_step,
                                              kept_floors, mixed_graph_mode, prefill_graph_mode)
from vllm_dsv41.model_executor.overlap import beside, prefetching
from vllm_dsv41.model_executor.step import Step, TokenHistory
from vllm_dsv41.ops import mhc as mhc_op
from vllm_dsv41.ops import sparse_attn_gathered
from vllm_dsv41.ops.sparse_attn import skip_empty_pays
from vllm_dsv41.ops.topk import blocks_to_mask
from vllm_dsv41.config import DSV41Config, LayerPlan, from_hf_config
from vllm_dsv41.engine_config import user_asked_eager
from vllm_dsv41.reference.model import (apply_rope, candidate_mask, clamped_swiglu_act, hc_coefficients,
                                        hc_collapse, hc_post,
                                        index_scores, rms_norm, rope_cos_sin, rope_inv_freq, route, sparse_attention,
                                        topk_select)

logger = logging.getLogger(__name__)

EXACT_ENV = "VLLM_DSV41_EXACT"
OPS_ENV = "VLLM_DSV41_OPS"


def exact_mode() -> bool:
    """``VLLM_DSV41_EXACT=1``: no bounded replay, no decoder pruning (bit-faithful to the full model)."""
    return os.environ.get(EXACT_ENV, "0") not in ("", "0", "false", "False")


def ops_mode() -> str:
    """``VLLM_DSV41_OPS``: ``auto`` (default: the ``torch.ops.dsv41`` ops on CUDA, the plain-PyTorch
    path elsewhere), ``1`` (the ops everywhere; on CPU they run their references) or ``0`` (the
    plain-PyTorch path everywhere)."""
    v = os.environ.get(OPS_ENV, "auto").strip().lower()
    if v in ("", "auto"):
        return "auto"
    if v in ("1", "true", "on", "yes"):
        return "1"
    if v in ("0", "false", "off", "no"):
        return "0"
    raise ValueError(f"{OPS_ENV}={v!r}: expected auto, 1 or 0")


CANDIDATE_SHORTCUT_ENV = "VLLM_DSV41_CANDIDATE_SHORTCUT"


def candidate_shortcut() -> bool:
    """``VLLM_DSV41_CANDIDATE_SHORTCUT``: ``1`` (default) lets the candidate source skip ``candidate_blocks`` where its
    host bound on the visible entries fits the candidate budget (every row would keep all its visible blocks, so the
    consumers' candidate filter admits every visible entry: they select as without one, bitwise); ``0`` always runs
    the source's blocks and the consumers' masking (the comparison)."""
    v = os.environ.get(CANDIDATE_SHORTCUT_ENV, "1").strip() or "1"
    if v not in ("1", "0"):
        raise ValueError(f"{CANDIDATE_SHORTCUT_ENV}={v!r}: expected 1 or 0")
    return v == "1"


RING_OP_ENV = "VLLM_DSV41_RING_STEP"


def ring_op() -> bool:
    """``VLLM_DSV41_RING_STEP``: ``1`` (default) gives a ratio-2 compressor its partner rows and its ring write through
    ``dsv41::ring_step`` on the ops path; ``0`` keeps the torch route (``Attention._partners``, ``_ring_write``)."""
    v = os.environ.get(RING_OP_ENV, "1").strip() or "1"
    if v not in ("1", "0"):
        raise ValueError(f"{RING_OP_ENV}={v!r}: expected 1 or 0")
    return v == "1"


FOLD_POST_ENV = "VLLM_DSV41_FOLD_POST"


def fold_post() -> bool:
    """``VLLM_DSV41_FOLD_POST``: ``1`` (default) leaves a layer's FFN post-mix to the next layer on the ops path, which
    folds it into its first mHC boundary (:class:`PendingPost`); ``0`` applies it at the end of the layer (the earlier
    order).  The streams are bitwise the same either way."""
    v = os.environ.get(FOLD_POST_ENV, "1").strip() or "1"
    if v not in ("1", "0"):
        raise ValueError(f"{FOLD_POST_ENV}={v!r}: expected 1 or 0")
    return v == "1"


INDEX_CHUNK_ENV = "VLLM_DSV41_INDEX_CHUNK_MIB"
# bytes a selection holds per (row, entry) at its peak: the fp32 scores, a consumer's masked fp32 copy, its candidate
# mask and that mask's complement
INDEX_BYTES_PER_ENTRY = 12


def index_chunk_rows(n_max: int) -> int:
    """Rows per indexer pass on the ops path, so that a pass's score rows ([rows, n_max] and what the selection derives
    from them, :data:`INDEX_BYTES_PER_ENTRY` a cell) stay within ``VLLM_DSV41_INDEX_CHUNK_MIB`` (default 1024; 0 = one
    pass whatever the size, the earlier behaviour).  Rows are selected independently, so the passes give the same
    indices as one."""
    mib = env_count(INDEX_CHUNK_ENV, 1024, "a whole number of MiB (0 = no limit)")
    if mib == 0:
        return 1 << 62
    return max(1, (mib << 20) // (INDEX_BYTES_PER_ENTRY * max(1, n_max)))


MOE_ADD_ENV = "VLLM_DSV41_MOE_ADD_IN_POST"


def moe_add_in_post() -> bool:
    """``VLLM_DSV41_MOE_ADD_IN_POST``: ``1`` (default) hands the MoE's routed and shared outputs to the FFN boundary's
    ``dsv41::mhc_post`` as two parts, which adds them as it reads them (one launch a layer fewer); ``0`` adds them in
    the MoE (``routed + shared``), the earlier order.  The streams are bitwise the same either way."""
    v = os.environ.get(MOE_ADD_ENV, "1").strip() or "1"
    if v not in ("1", "0"):
        raise ValueError(f"{MOE_ADD_ENV}={v!r}: expected 1 or 0")
    return v == "1"


STREAMS_ENV = "VLLM_DSV41_STREAMS"


def stream_dtype(wf: WeightFormat) -> torch.dtype:
    """``VLLM_DSV41_STREAMS``: the dtype of the mHC residual streams between layers.  ``auto`` (default): the fast
    CUDA path's activation dtype (bf16, as vLLM's built-in V4.1 keeps its residual streams; the mHC ops compute in
    fp32 and round what they store: half the bytes of the fp32 streams, which every boundary reads and writes), fp32
    elsewhere (the reference, exact mode); ``fp32`` keeps fp32 streams on the fast path (the comparison)."""
    v = os.environ.get(STREAMS_ENV, "auto").strip().lower()
    if v not in ("", "auto", "fp32"):
        raise ValueError(f"{STREAMS_ENV}={v!r}: expected auto or fp32")
    return wf.dense_dtype if wf.cuda_fast and v != "fp32" else torch.float32


def use_ops(mode: str, device: torch.device) -> bool:
    return mode == "1" or (mode == "auto" and device.type == "cuda")


@functools.cache
def _ops():
    """``torch.ops.dsv41`` with every op of the package registered."""
    from vllm_dsv41.ops import (compressor, indexer, mhc, moe_gemv, moe_mxfp4, ring, rope, router,  # noqa: F401
                                sparse_attn, swa_insert, swiglu_quant, topk)

    return torch.ops.dsv41


class Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)


def _param(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)


# --------------------------------------------------------------------------- attention


class Compressor(nn.Module):
    def __init__(self, cfg: DSV41Config, plan: LayerPlan, wf: WeightFormat):
        super().__init__()
        self.wkv = Dense(cfg.head_dim, cfg.hidden_size, wf.dense_dtype)
        if plan.compress_ratio == 2:
            self.wgate = Dense(cfg.head_dim, cfg.hidden_size, wf.dense_dtype)
        self.norm = Norm(cfg.head_dim)


class Indexer(nn.Module):
    def __init__(self, cfg: DSV41Config, plan: LayerPlan, wf: WeightFormat):
        super().__init__()
        self.wq_b = QuantLinear(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, wf.quant)
        self.weights_proj = Dense(cfg.index_n_heads, cfg.hidden_size, wf.dense_dtype)
        if plan.owns_compressor:
            self.wk = Dense(cfg.index_head_dim, cfg.head_dim, wf.dense_dtype)
            self.k_norm = Norm(cfg.index_head_dim)


class Attention(nn.Module):
    """CSA2 attention of one layer (§2.5) over engine-allocated paged caches."""

    def __init__(self, cfg: DSV41Config, plan: LayerPlan, prefix: str, bounded_replay: bool, wf: WeightFormat):
        super().__init__()
        self.cfg, self.plan, self.prefix = cfg, plan, prefix
        # the candidate source may skip publishing blocks that would all be kept only where its consumers see the
        # same entries per row as it does (the same compression ratio: the same visible counts at a position)
        self.candidates_skippable = plan.is_candidate_source and all(
            p.compress_ratio == plan.compress_ratio for p in cfg.plans if p.is_candidate_consumer)
        D, H, q = cfg.head_dim, cfg.hidden_size, wf.quant
        self.wq_a = QuantLinear(cfg.q_lora_rank, H, q)
        self.q_norm = Norm(cfg.q_lora_rank)
        self.wkv = QuantLinear(D, H, q)
        self.kv_norm = Norm(D)
        self.wq_b = QuantLinear(cfg.num_attention_heads * D, cfg.q_lora_rank, q)
        self.wo_a = QuantLinear(cfg.o_groups * cfg.o_lora_rank, cfg.heads_per_group * D, q, groups=cfg.o_groups)
        self.wo_b = QuantLinear(H, cfg.o_groups * cfg.o_lora_rank, q)
        self.attn_sink = _param(cfg.num_attention_heads)
        self.wqkv_a: QuantLinear | None = None  # [wq_a; wkv] as one GEMM (fast CUDA path, see finalize)
        if plan.owns_compressor:
            self.compressor = Compressor(cfg, plan, wf)
        if plan.owns_indexer:
            self.indexer = Indexer(cfg, plan, wf)
        self.register_buffer("inv_freq", rope_inv_freq(plan.rope, cfg.qk_rope_head_dim), persistent=False)
        self.eps = float(cfg.rms_norm_eps)
        self.norm = fused_rms_norm if wf.cuda_fast else rms_norm
        # the fast path's attention runs on queries in the GEMMs' own dtype (bf16): half the bytes, and the
        # sparse-attention tiles fit the 64-head warp-group MMA config
        self.q_dtype = wf.dense_dtype if wf.cuda_fast else None
        self._q_norm_weights: dict[torch.dtype, torch.Tensor] = {}  # the q norm's weight in other input dtypes
        self._q_rows_quantisable: bool | None = None  # _q_norm_quantises' weight/switch part, decided on first use
        self._x_rows_quantisable: bool | None = None  # the same for the layer input (takes_quantised_input)
        # engine caches (not parameters): registered in vLLM's forward context by prefix
        self.swa_cache = caches.SWACache(f"{prefix}.swa_cache", D, cfg.sliding_window,
                                         bounded_replay=bounded_replay)
        if plan.owns_compressor:
            r = plan.compress_ratio
            self.comp_cache = caches.CompressedCache(f"{prefix}.comp_cache", D, r, COMPRESSED_BLOCK_SIZE)
            self.index_cache = caches.CompressedCache(f"{prefix}.indexer.k_cache", cfg.index_head_dim, r,
                                                      COMPRESSED_BLOCK_SIZE, index=True)
            if r == 2:
                self.ring = caches.CompressorRing(f"{prefix}.compressor.state_cache", D)

    def finalize(self) -> None:
        """After loading, before the children's own repack: on the fast CUDA path wq_a and wkv, which read
        the same input, become one Marlin GEMM; the q norm's weight is also held in the query dtype (the
        fused norm takes input and weight in one dtype)."""
        self.wqkv_a = fuse_rows_on_cuda(self.wq_a, self.wkv)
        if self.q_dtype is not None:
            self._q_norm_weights[self.q_dtype] = self.q_norm.weight.to(self.q_dtype)

    def takes_quantised_input(self, dtype: torch.dtype) -> bool:
        """Whether the layer input x of ``dtype`` may also arrive quantised per token (``QuantRows``, from the mHC
        collapse that makes x: ``dsv41::mhc_collapse_quant``) for the fused ``[wq_a; wkv]``: a ``w8a8`` GEMM that would
        quantise x itself (``linear.reads_quantised_rows``), x already in the query dtype (no cast before it)."""
        if self.wqkv_a is None or dtype != self.q_dtype:
            return False
        if self._x_rows_quantisable is None:  # the weight and the switches are fixed after loading
            self._x_rows_quantisable = reads_quantised_rows([self.wqkv_a], dtype, activation=True)
        return self._x_rows_quantisable

    def _qkv_a(self, x: torch.Tensor, ops: bool, xq: QuantRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x @ wq_a^T, x @ wkv^T); with the fused GEMM on the ops path, in the query dtype (one cast of x,
        none of the products: the q norm, wq_b, the indexer's queries and the SWA write all take it); ``xq``: x
        already quantised (:meth:`takes_quantised_input`), which the fused GEMM then reads instead."""
        if self.wqkv_a is None:
            return self.wq_a(x), self.wkv(x)
        y = self.wqkv_a(xq if xq is not None else x.to(self.q_dtype) if ops else x)
        return y[:, : self.cfg.q_lora_rank], y[:, self.cfg.q_lora_rank:]

    # -- cache writes (all rows whose KV this layer produces)
    def _write_swa(self, step: Step, tok: torch.Tensor, kv: torch.Tensor) -> None:
        slots = step.take(step.group(self.swa_cache.prefix).slot_mapping, tok)
        self.swa_cache.write(slots, formats.encode_mxfp8_record(kv))

    def _partners(self, step: Step, tok: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Ratio 2: the compressor row of position p-1 for every token (the partner of a closing
        token): the previous row of this step when it is that position of the same request, else
        the request's ring.  Read before this step's ring write.  [T, 2D]."""
        pos, req = step.rows_of(tok)
        ring_md, cap = step.group(self.ring.prefix), self.ring.capacity
        t = torch.arange(tok.numel(), device=rows.device)
        before = (t - 1).clamp(min=0)
        in_step = (t > 0) & (req[before] == req) & (pos[before] == pos - 1)
        from_ring = self.ring.read(ring_md.ring_block_ids[req] * cap + (pos - 1) % cap)
        return torch.where(in_step[:, None], rows[before], from_ring)

    def _ring_write(self, step: Step, tok: torch.Tensor, rows: torch.Tensor) -> None:
        """The ring keeps each request's last ``capacity`` positions of this step."""
        pos, req = step.rows_of(tok)
        last = step.seq_lens[req] - 1
        keep = pos > last - self.ring.capacity
        slots = step.take(step.group(self.ring.prefix).slot_mapping, tok)
        self.ring.write(torch.where(keep, slots, torch.full_like(slots, -1)), rows)

    def _ring_step(self, step: Step, tok: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """:meth:`_partners` then :meth:`_ring_write` as one op (``dsv41::ring_step``: two launches for ~20)."""
        pos, req = step.rows_of(tok)
        md = step.group(self.ring.prefix)
        flat, bstep, rstep = self.ring.flat_rows()
        return _ops().ring_step(rows, pos, req, step.seq_lens, md.ring_block_ids, step.take(md.slot_mapping, tok),
                                flat, self.ring.capacity, self.ring.rows_per_block, bstep, rstep)

    def _compress(self, step: Step, tok: torch.Tensor, x: torch.Tensor) -> None:
        """Compressor (§2.5.4): entries closed by this step's tokens -> compressed KV and index K."""
        cfg, plan = self.cfg, self.plan
        r, D = plan.compress_ratio, cfg.head_dim
        pos = step.positions[tok]
        kv_c = self.compressor.wkv(x)
        ci = ((pos + 1) % r == 0).nonzero().flatten()  # tokens that close an entry
        if r == 2:
            rows = torch.cat((kv_c, self.compressor.wgate(x)), -1)  # [T, 2D] compressor input
            prev = self._partners(step, tok, rows)[ci]
            self._ring_write(step, tok, rows)
            pair = torch.stack((prev, rows[ci]), 1)  # [J, 2, 2D]
            pooled = (pair[..., :D] * torch.softmax(pair[..., D:], dim=1)).sum(1)
        else:
            pooled = kv_c[ci]
        comp_slots = step.group(self.comp_cache.prefix).slot_mapping[tok[ci]]
        live = comp_slots >= 0  # replayed tokens keep the cached (possibly shared) entries
        if not bool(live.any()):
            return
        ci, pooled, comp_slots = ci[live], pooled[live], comp_slots[live]
        z = rms_norm(pooled, self.compressor.norm.weight, self.eps)
        ent_pos = (pos[ci] // r) * r
        z_rot = apply_rope(z, ent_pos, self.inv_freq)
        k_idx = rms_norm(self.indexer.wk(z), self.indexer.k_norm.weight, self.eps)
        k_idx = apply_rope(k_idx, ent_pos, self.inv_freq)
        self.comp_cache.write(comp_slots, formats.encode_nvfp4_record(z_rot))
        idx_slots = step.group(self.index_cache.prefix).slot_mapping[tok[ci]]
        self.index_cache.write(idx_slots, formats.encode_mxfp4_record(k_idx))

    def _write_slots(self, step: Step, cache: caches.DSV41CacheLayer, tok: torch.Tensor) -> torch.Tensor:
        """Flat rows the step's tokens ``tok`` write in ``cache`` (-1 = none); over all rows, shared by the
        layers of one group and cache geometry."""
        g = step.group(cache.prefix)
        if tok is not step.all_rows(step.num_tokens):
            return cache.flat_slots(g.slot_mapping[tok])

        e = cache.rows_per_block

        def every_group() -> dict[int, torch.Tensor]:
            """One launch chain for the groups of this kind and block geometry (14 SWA groups at the bench
            config) under this cache's row steps, the first time a layer asks."""
            views = [v for v in step.views_of_kind(g.kind) if v.rows_per_block == e]
            flat = cache.flat_slots(torch.stack([v.slot_mapping for v in views]))
            return {id(v): flat[i] for i, v in enumerate(views)}

        return step.once(("write_slots", g.kind, e, cache.flat_rows()[1:]), every_group)[id(g)]

    def _compress_ops(self, step: Step, tok: torch.Tensor, x: torch.Tensor) -> None:
        """``_compress`` through ``dsv41::compress_insert`` (pooling, norms, RoPE, records, writes)."""
        r = self.plan.compress_ratio
        kv_c = self.compressor.wkv(x)
        prev = None
        if r == 2:
            kv_score = torch.cat((kv_c, self.compressor.wgate(x)), -1)
            if ring_op():
                prev = self._ring_step(step, tok, kv_score)
            else:
                prev = self._partners(step, tok, kv_score)
                self._ring_write(step, tok, kv_score)
        else:
            kv_score = kv_c
        comp_slots = self._write_slots(step, self.comp_cache, tok)
        idx_slots = self._write_slots(step, self.index_cache, tok)
        _ops().compress_insert(kv_score, prev, step.rows_of(tok)[0], r, self.compressor.norm.weight,
                               self.indexer.wk.weight, self.indexer.k_norm.weight, self.eps, self.inv_freq,
                               comp_slots, idx_slots, self.comp_cache.flat_rows()[0],
                               self.index_cache.flat_rows()[0])

    # -- per-request selection and attention (plain PyTorch)
    def _select(self, model: "DeepseekV41Model", step: Step, i: int, pos: torch.Tensor,
                x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        cfg, plan = self.cfg, self.plan
        dev = x.device
        n_vis = (pos + 1) // plan.compress_ratio
        N = int(n_vis.max())
        src = model.attn_of(plan.kv_source)
        slots = step.group(src.index_cache.prefix).slots_of_entries(i, torch.arange(N, device=dev))
        keys = formats.decode_mxfp4_record(src.index_cache.read(slots), cfg.index_head_dim)
        qi = self.indexer.wq_b(qr).view(-1, cfg.index_n_heads, cfg.index_head_dim)
        qi = apply_rope(qi, pos, self.inv_freq)
        w = self.indexer.weights_proj(x) * (cfg.index_head_dim ** -0.5) * (cfg.index_n_heads ** -0.5)
        scores = index_scores(qi, w, keys)
        scores = scores.masked_fill(torch.arange(N, device=dev)[None, :] >= n_vis[:, None], float("-inf"))
        if plan.is_candidate_source:
            step.scratch[("cand", i)] = candidate_mask(scores, n_vis, cfg.candidate_block_size,
                                                       cfg.candidate_topk_blocks)
        elif plan.is_candidate_consumer and ("cand", i) in step.scratch:
            cand = step.scratch[("cand", i)][:, :N]
            return topk_select(scores.masked_fill(~cand, float("-inf")), n_vis, cfg.index_topk) & cand
        return topk_select(scores, n_vis, cfg.index_topk)

    def _attend_torch(self, model: "DeepseekV41Model", step: Step, q: torch.Tensor, out_tok: torch.Tensor,
                      xr: torch.Tensor, qr: torch.Tensor, floors: torch.Tensor) -> torch.Tensor:
        """Per request: gather and decode the records, masked dense attention (``sparse_attention``),
        inverse RoPE.  q [R, Hq, D] -> [R, Hq, D]."""
        cfg, plan = self.cfg, self.plan
        D, W = cfg.head_dim, cfg.sliding_window
        dev = q.device
        out = torch.empty_like(q)
        swa_md = step.group(self.swa_cache.prefix)
        req_of = step.req_idx[out_tok]
        for i in req_of.unique().tolist():
            sel_rows = (req_of == i).nonzero().flatten()
            pos = step.positions[out_tok[sel_rows]]
            floor = int(floors[i])
            hi = int(pos.max()) + 1
            lo = max(int(pos.min()) - W + 1, floor, 0)
            kp = torch.arange(lo, hi, device=dev)
            keys = formats.decode_mxfp8_record(self.swa_cache.read(swa_md.slots_of_entries(i, kp)), D)
            mask = (kp[None, :] <= pos[:, None]) & (kp[None, :] > pos[:, None] - W) & (kp[None, :] >= floor)
            if plan.compress_ratio > 0:
                if plan.owns_indexer:
                    step.scratch[("topk", plan.layer_id, i)] = self._select(model, step, i, pos, xr[sel_rows],
                                                                             qr[sel_rows])
                sel = step.scratch[("topk", plan.index_source, i)]
                src = model.attn_of(plan.kv_source)
                N = sel.shape[1]
                slots = step.group(src.comp_cache.prefix).slots_of_entries(i, torch.arange(N, device=dev))
                comp = formats.decode_nvfp4_record(src.comp_cache.read(slots), D)
                keys = torch.cat((keys, comp))
                mask = torch.cat((mask, sel), 1)
            out[sel_rows] = sparse_attention(q[sel_rows], keys, mask, self.attn_sink, D ** -0.5)
        return apply_rope(out, step.positions[out_tok], self.inv_freq, inverse=True)

    # -- whole-batch selection and attention through the ops
    def _select_ops(self, model: "DeepseekV41Model", step: Step, pos: torch.Tensor, req: torch.Tensor,
                    x: torch.Tensor, qr: torch.Tensor | QuantRows) -> torch.Tensor:
        """Indexer of this layer for every attention row: entry ids [R, index_topk] (-1 = none), from
        ``index_scores`` + ``candidate_blocks`` / ``topk_select``."""
        cfg, plan = self.cfg, self.plan
        ops = _ops()
        r = plan.compress_ratio
        # pos / req are step-held (Step.rows_of): shared by every index layer of this ratio and row set
        n_vis = step.once(("n_vis", r, id(pos)), lambda: ((pos + 1) // r).to(torch.int32))
        req32 = step.once(("req_idx_i32", id(req)), lambda: req.to(torch.int32))
        n_max = (step.max_position + 1) // r  # host bound, >= every row's n_vis (extra columns are -inf)
        src = model.attn_of(plan.kv_source)
        qi = self.indexer.wq_b(qr).view(-1, cfg.index_n_heads, cfg.index_head_dim)
        qi = self._rope(step, qi, pos)
        w = self.indexer.weights_proj(x) * (cfg.index_head_dim ** -0.5) * (cfg.index_n_heads ** -0.5)
        cache, table, rows_per_block = model.index_view(step, src, n_max)
        # every row keeps all of its at most ceil(n_max / block) visible blocks when they fit the budget; the
        # consumers, finding no blocks, select as they would through a filter that admits every visible entry
        make_blocks = plan.is_candidate_source and not (
            -(-n_max // cfg.candidate_block_size) <= cfg.candidate_topk_blocks
            and self.candidates_skippable and candidate_shortcut())
        blocks = (step.scratch.get("cand_blocks") if plan.is_candidate_consumer and not plan.is_candidate_source
                  else None)
        R = qi.shape[0]
        chunk = index_chunk_rows(n_max)  # a long prefill's score rows, [R, n_max] fp32, in passes of bounded size
        picked, made = [], []
        for a in range(0, max(R, 1), chunk):
            rows = slice(a, min(R, a + chunk))
            scores = ops.index_scores(qi[rows], w[rows], cache, table, rows_per_block, req32[rows], n_vis[rows], n_max)
            if make_blocks:
                made.append(ops.candidate_blocks(scores, n_vis[rows], cfg.candidate_block_size,
                                                 cfg.candidate_topk_blocks))
            if blocks is not None:
                cand = blocks_to_mask(blocks[rows], cfg.candidate_block_size, n_max)
                idx = ops.topk_select(scores.masked_fill(~cand, float("-inf")), n_vis[rows], cfg.index_topk)
                hit = (idx >= 0) & cand.gather(1, idx.clamp(min=0).long())
                picked.append(torch.where(hit, idx, torch.full_like(idx, -1)))
            else:
                picked.append(ops.topk_select(scores, n_vis[rows], cfg.index_topk))
            del scores
        if made:
            step.scratch["cand_blocks"] = made[0] if len(made) == 1 else torch.cat(made)
        return picked[0] if len(picked) == 1 else torch.cat(picked)

    def _swa_slots(self, step: Step, pos: torch.Tensor, req: torch.Tensor, floors: torch.Tensor) -> torch.Tensor:
        """SWA keys of every row: positions max(p - W + 1, floor, 0) .. p, as rows of the flat SWA
        cache view, -1 padded.  [R, W] int64 (a large pool's flat rows pass 2^31).  pos / req come from
        ``Step.rows_of`` and floors from the model's loop, all step-held: the positions are made once per row set
        and floors, their rows once more per group and cache geometry (shared by the layers, the decoder's
        pruned rows included)."""
        g = step.group(self.swa_cache.prefix)
        geometry = self.swa_cache.flat_rows()[1:]

        def positions() -> torch.Tensor:
            W = self.cfg.sliding_window
            kp = pos[:, None] - (W - 1) + torch.arange(W, device=pos.device)[None, :]
            return torch.where(kp >= floors[req].clamp(min=0)[:, None], kp, torch.full_like(kp, -1))

        kp = step.once(("swa_positions", id(pos), id(floors)), positions)
        return step.once(("swa_slots", id(g), geometry, id(pos), id(floors)), lambda: g.slots_of(req, kp, geometry))

    def _attend_ops(self, model: "DeepseekV41Model", step: Step, q: torch.Tensor, out_tok: torch.Tensor,
                    floors: torch.Tensor) -> torch.Tensor:
        """All rows at once through ``dsv41::sparse_attn`` (inverse RoPE included), over the selection the step
        holds (this layer's own, made in ``forward``, or its index source's)."""
        cfg, plan = self.cfg, self.plan
        pos, req = step.rows_of(out_tok)
        src = comp_cache = comp_slots = None
        if plan.compress_ratio > 0:
            src = model.attn_of(plan.kv_source)
            comp_slots = step.once(  # shared by the selection's consumers
                ("comp_slots", plan.index_source, plan.kv_source),
                lambda: step.group(src.comp_cache.prefix).slots_of(
                    req, step.scratch[("topk_ids", plan.index_source)], src.comp_cache.flat_rows()[1:]))
            comp_cache = src.comp_cache.flat_rows()[0]
        route = None
        if (not in_static_step() or step.gathers_when_static) and sparse_attn_gathered.applies(q, q.shape[0]):
            def route():
                return self._attend_gathered(step, q, pos, req, floors, src, comp_slots)
        elif sparse_attn_gathered.applies_rows(q, q.shape[0]):
            def route():
                return sparse_attn_gathered.sparse_attn_rows(
                    q, self.swa_cache.flat_rows()[0], self._swa_slots(step, pos, req, floors), comp_cache,
                    comp_slots, self.attn_sink, cfg.head_dim ** -0.5, pos, self.inv_freq)
        if route is not None:  # FlashMLA's kernel on gathered bf16 keys
            try:
                return route()
            except Exception as exc:  # noqa: BLE001 - a kernel that refuses the step: serve it the other way
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise  # a failed capture leaves those steps eager (graphs._GraphSet._capture), the path on
                if not isinstance(exc, torch.OutOfMemoryError):  # no room for the bf16 keys: this step only
                    sparse_attn_gathered.switch_off(exc)
        # prefill rows of short contexts: the kernel skips their key tiles of -1 (not inside a captured step,
        # whose launch is replayed for any context)
        skip = not in_static_step() and skip_empty_pays(q.shape[0], step.max_position, cfg.topk_fill_context)
        return _ops().sparse_attn(q, self.swa_cache.flat_rows()[0], self._swa_slots(step, pos, req, floors),
                                  comp_cache, comp_slots, self.attn_sink, cfg.head_dim ** -0.5, pos,
                                  self.inv_freq, skip)

    def _attend_gathered(self, step: Step, q: torch.Tensor, pos: torch.Tensor, req: torch.Tensor,
                         floors: torch.Tensor, src, comp_slots: torch.Tensor | None) -> torch.Tensor:
        """Prefill rows through FlashMLA's sparse prefill kernel on gathered bf16 keys (``ops.sparse_attn_gathered``;
        the default where it applies, ``VLLM_DSV41_PREFILL_ATTN=sparse_attn`` switches it off).  The gather plans
        are made once per slot list and step: the SWA one is shared by the layers of a group over the same rows (the
        step's own, or the decoder's pruned ones), the compressed one by the consumers of a selection; their sizes come
        from host-side bounds (no host read; inside a static decoder step the bucket's, ``StaticStep.gather_bounds``), or
        with ``VLLM_DSV41_PLAN_READBACK=1`` from ``nonzero`` (eager steps only)."""
        plan = self.plan
        swa_flat, bstep, rstep = self.swa_cache.flat_rows()
        swa_slots = self._swa_slots(step, pos, req, floors)
        bounded = in_static_step() or not sparse_attn_gathered.read_back()
        e = self.swa_cache.rows_per_block
        ratio = src.plan.compress_ratio if src is not None else 0
        ec = src.comp_cache.rows_per_block if src is not None else 1
        swa_bound, comp_bound = step.once(("gather_bounds", e, ratio, ec),
                                          lambda: step.gather_bounds(self.cfg.sliding_window, e, ratio, ec)
                                          ) if bounded else (None, None)

        def swa_plan_of():
            return sparse_attn_gathered.gather_plan(swa_slots, bstep, rstep, e, swa_flat.shape[0], swa_bound)

        # one plan per slot list (step-held: _swa_slots shares it by group, geometry and row set) and cache size
        swa_plan = step.once(("gather_swa", id(swa_slots), swa_flat.shape[0]), swa_plan_of)
        comp_flat = comp_plan = comp_steps = None
        if src is not None:
            comp_flat, cb, cr = src.comp_cache.flat_rows()
            comp_steps = (cb, cr)
            comp_plan = step.once(("gather_comp", plan.index_source, plan.kv_source),
                                  lambda: sparse_attn_gathered.gather_plan(
                                      comp_slots, cb, cr, ec, comp_flat.shape[0], comp_bound))
        return sparse_attn_gathered.sparse_attn_gathered(
            q, swa_flat, swa_plan, (bstep, rstep), comp_flat, comp_plan, comp_steps, self.attn_sink,
            self.cfg.head_dim ** -0.5, pos, self.inv_freq)

    def _rope(self, step: Step, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``apply_rope`` (``dsv41::rope_``, in place, on the ops path: x is always a fresh GEMM output here); on
        the plain path over the step's own positions the cos/sin are computed once per step and RoPE setting and
        shared by every layer (same bits)."""
        if step.use_ops:
            _ops().rope_(x, pos, self.inv_freq)
            return x
        cs = step.once(("rope", self.plan.rope) if pos is step.positions else None,
                       lambda: rope_cos_sin(pos, self.inv_freq))
        return apply_rope(x, pos, self.inv_freq, cos_sin=cs)

    def _q_norm_quantises(self, ops: bool, dtype: torch.dtype, rows: int) -> bool:
        """Whether the q norm quantises its ``rows`` rows in the same launch (``linear.fused_rms_norm_quant``, one
        :class:`~vllm_dsv41.model_executor.linear.QuantRows` for ``wq_b`` and, where this layer selects, the
        indexer's ``wq_b``): on the fast path's ops, up to ``linear.FUSED_QUANT_MAX_ROWS`` rows, when every reader of
        the normalised rows there is a ``w8a8`` GEMM that would quantise them itself (``linear.reads_quantised_rows``).
        The plain path reads bf16 rows."""
        if not ops or self.q_dtype != dtype or rows > FUSED_QUANT_MAX_ROWS:  # q_dtype is None off the fast path
            return False
        if self._q_rows_quantisable is None:  # the readers' weights and the switches are fixed after loading
            readers = [self.wq_b]
            if self.plan.compress_ratio > 0 and self.plan.owns_indexer:
                readers.append(self.indexer.wq_b)
            self._q_rows_quantisable = reads_quantised_rows(readers, dtype)
        return self._q_rows_quantisable

    def forward(self, model: "DeepseekV41Model", step: Step, x: torch.Tensor, tok: torch.Tensor,
                rows: torch.Tensor, floors: torch.Tensor, xq: QuantRows | None = None) -> torch.Tensor:
        """x [len(tok), H] for the step tokens ``tok``; KV is written for all of them, attention output
        is returned for ``tok[rows]`` only.  ``floors[i]``: lowest SWA position request i may read.  ``xq``: x's rows
        quantised per token as well (:meth:`takes_quantised_input`)."""
        cfg, plan = self.cfg, self.plan
        D = cfg.head_dim
        qa, kv_raw = self._qkv_a(x, step.use_ops, xq)
        quantised = self._q_norm_quantises(step.use_ops, qa.dtype, qa.shape[0])
        norm = fused_rms_norm_quant if quantised else self.norm
        qr_all = norm(qa, self._q_norm_weights.get(qa.dtype, self.q_norm.weight), self.eps)
        if step.use_ops:  # norm, RoPE, MXFP8 record and write in one op
            _ops().swa_insert(kv_raw, self.kv_norm.weight, self.eps, step.rows_of(tok)[0],
                              self.inv_freq, self._write_slots(step, self.swa_cache, tok),
                              self.swa_cache.flat_rows()[0])
        else:
            kv = self.norm(kv_raw, self.kv_norm.weight, self.eps)
            self._write_swa(step, tok, self._rope(step, kv, step.rows_of(tok)[0]))
        out_tok = step.take(tok, rows)
        xr = step.take(x, rows)
        qr = qr_all.rows(lambda t: step.take(t, rows)) if quantised else step.take(qr_all, rows)
        q_in = qr.to(self.q_dtype) if step.use_ops and self.q_dtype is not None and not quantised else qr

        def query() -> torch.Tensor:
            return self._rope(step, self.wq_b(q_in).view(-1, cfg.num_attention_heads, D), step.rows_of(out_tok)[0])

        if not step.use_ops:
            if plan.owns_compressor:
                self._compress(step, tok, x)
            o = self._attend_torch(model, step, query(), out_tok, xr, qr, floors)
        else:
            # the compressor's cache writes and this layer's selection do not need the queries: on the side stream
            # beside wq_b (model_executor/overlap); the attention after the join reads both
            pos, req = step.rows_of(out_tok)  # step-held, made before the fork
            selects = plan.compress_ratio > 0 and plan.owns_indexer

            def side() -> None:
                if plan.owns_compressor:
                    self._compress_ops(step, tok, x)
                if selects:
                    step.scratch[("topk_ids", plan.layer_id)] = self._select_ops(model, step, pos, req, xr, qr)

            if plan.owns_compressor or selects:
                q, _ = beside(xr, side, query)  # xr: qr's rows and device (qr may be QuantRows)
            else:
                q = query()
            o = prefetching(xr, self.wo_a.weight_read(xr.shape[0]),
                            lambda: self._attend_ops(model, step, q, out_tok, floors))
        z = self.wo_a(o.reshape(-1, cfg.o_groups, cfg.heads_per_group * D))
        return self.wo_b(z.flatten(1))  # bf16 on the fast path: the mHC post-mix reads it in fp32


# --------------------------------------------------------------------------- MoE, Engram


class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, quant: bool, limit: float):
        super().__init__()
        self.w1 = QuantLinear(inter, hidden, quant)
        self.w3 = QuantLinear(inter, hidden, quant)
        self.w2 = QuantLinear(hidden, inter, quant)
        self.w13: QuantLinear | None = None  # [w1; w3] as one GEMM (fast CUDA path)
        self.inter, self.limit = inter, limit
        self._h_rows_quantisable: bool | None = None  # whether w2 takes pre-quantised rows (decided on first use)

    def finalize(self) -> None:
        self.w13 = fuse_rows_on_cuda(self.w1, self.w3)

    def forward(self, x: torch.Tensor | QuantRows) -> torch.Tensor:
        """The clamped SwiGLU of ``swiglu_clamped`` over this expert's FP8 weights; on the fast path one
        GEMM for [w1; w3] (which may take x already quantised: ``MoE.takes_quantised_input``) and vLLM's fused
        ``silu(min(a, L)) * clamp(b, -L, L)`` kernel."""
        if self.w13 is None:
            return self.w2(clamped_swiglu_act(self.w1(x), self.w3(x), self.limit))
        from vllm.model_executor.layers.fused_moe.activation import silu_and_mul_with_clamp

        y = self.w13(x)
        if self._w2_takes_rows(y):  # the activation and w2's per-token quantisation in one launch
            _, q, s = _ops().swiglu_quant(y, self.limit)
            return self.w2(QuantRows(q, s, y.dtype))
        h = y.new_empty(y.shape[0], self.inter)
        silu_and_mul_with_clamp(h, y, self.limit)
        return self.w2(h)

    def _w2_takes_rows(self, y: torch.Tensor) -> bool:
        """Whether ``dsv41::swiglu_quant`` serves this pass: up to ``linear.FUSED_QUANT_MAX_ROWS`` rows, w2 a ``w8a8``
        GEMM that would quantise h per token itself (``linear.reads_quantised_rows``, on h's dtype)."""
        if y.shape[0] > FUSED_QUANT_MAX_ROWS:
            return False
        if self._h_rows_quantisable is None:
            self._h_rows_quantisable = reads_quantised_rows([self.w2], y.dtype, activation=True)
        return self._h_rows_quantisable


class Gate(nn.Module):
    """Router weight in the checkpoint's bf16 on the fast path (``dsv41::router`` splits the fp32 input into
    three bf16 parts for tensor cores; an fp32 weight sends it to the FMA dot: 27.8 µs a launch in a batch-64
    decode step against 7.6 µs for the bf16 weight alone, docs/benchmarks.md session 10), bias fp32."""

    def __init__(self, n_experts: int, hidden: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = _param(n_experts, hidden, dtype=dtype)
        self.bias = _param(n_experts)


class MoE(nn.Module):
    """sqrtsoftplus-routed experts + shared expert, clamped SwiGLU (§2.7)."""

    def __init__(self, cfg: DSV41Config, plan: LayerPlan, wf: WeightFormat):
        super().__init__()
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.k, self.scale, self.limit = plan.experts_per_tok, float(cfg.routed_scaling_factor), float(cfg.swiglu_limit)
        self.gate = Gate(plan.n_routed_experts, H, wf.dense_dtype)
        self.experts = nn.ModuleList(Expert(H, I, wf.quant) for _ in range(plan.n_routed_experts))
        self.shared_experts = SharedExpert(H, I * cfg.n_shared_experts, wf.quant, self.limit)
        self.marlin: tuple[torch.Tensor, ...] | None = None  # stacked MXFP4 experts (quantised, CUDA)
        self.mxfp4: tuple[torch.Tensor, ...] | None = None  # the checkpoint's MXFP4 bytes stacked (moe_mxfp4, bf16_moe)
        self.ogs: tuple | None = None  # the same bytes in matmul_ogs' layouts (VLLM_DSV41_MOE=ogs)
        self.bf16_from = 0  # tokens from which a forward takes bf16_moe (0: never)
        self.fp8_from = 0  # tokens from which a forward takes fp8_moe (0: never; before bf16_from)
        self.gemv_rows = 0  # tokens up to which a forward takes dsv41::moe_gemv (0: never)
        self.fp8_rows: tuple[torch.Tensor, ...] | None = None  # fp8_moe's per-row exponents and scales
        self.act_dtype = wf.dense_dtype  # the experts' input dtype on the fast path
        self._x_rows_quantisable: bool | None = None  # takes_quantised_input's weight/switch part

    def finalize(self) -> None:
        """After loading: quantised experts on CUDA become one MXFP4 stack (Marlin's, matmul_ogs', or ours)."""
        if self.experts[0].quant and on_fast_device(self.gate.weight):
            inter, half_hidden = self.experts[0].w1.weight.shape  # packed MXFP4: two values a byte
            backend = resolve_moe_backend(moe_backend(), 2 * half_hidden, inter)
            if backend == "loop":  # widths no fused kernel tiles: the experts stay, dequantised per call
                log_moe_choice(backend, 0)
                return
            self.bf16_from = moe_bf16_from(backend)
            self.fp8_from = moe_fp8_from(self.gate.weight.device)
            self.gemv_rows = moe_gemv_rows(self.gate.weight.device)
            log_moe_choice(backend, self.bf16_from, self.fp8_from, self.gemv_rows)
            if backend == "ogs":  # first: a missing triton_kernels fails the engine start before other work
                self.ogs = ogs_expert_stack(self.experts)
            if backend == "triton" or self.bf16_from or self.fp8_from or self.gemv_rows:
                self.mxfp4 = mxfp4_expert_stack(self.experts)
            if self.gemv_rows:
                from vllm_dsv41.model_executor.overlap import side_streams
                from vllm_dsv41.ops import moe_gemv

                # moe_gemv's split counters (fp8_gemv's, per stream) and diagonal buffers exist before any graph is
                # captured
                dev = self.gate.weight.device
                moe_gemv.reserve(dev, 2 * half_hidden, inter, self.k, self.gemv_rows, side_streams(dev))
            if self.fp8_from:
                self.fp8_rows = fp8_row_exponents(self.mxfp4)
            if backend == "marlin":
                self.marlin = marlin_expert_stack(self.experts)
            del self.experts

    def _route(self, x: torch.Tensor, ops: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if ops:
            return _ops().router(x, self.gate.weight, self.gate.bias, self.k, self.scale)
        return route(x, self.gate.weight.to(x.dtype), self.gate.bias, self.k, self.scale)

    def _routed(self, x: torch.Tensor, xb: torch.Tensor, ops: bool) -> torch.Tensor:
        """Router and routed experts through the fused stack chosen at load (x for the router, xb for the experts)."""
        idx, wts = self._route(x, ops)
        T = x.shape[0]
        if not in_static_step():  # the prefill paths, eager steps only
            if self.fp8_from and T >= self.fp8_from:
                return fp8_moe(xb, self.mxfp4, self.fp8_rows, idx, wts, self.limit)
            if self.bf16_from and T >= self.bf16_from:
                return bf16_moe(xb, self.mxfp4, idx, wts, self.limit)
        if T <= self.gemv_rows and xb.dtype == torch.bfloat16:  # no host sync: also inside captured decode steps
            # the chosen experts' w2 (and scales) asked of the L2 while the first GEMM runs (VLLM_DSV41_L2_PREFETCH)
            return prefetching(xb, self.mxfp4[2:], lambda: _ops().moe_gemv(xb, *self.mxfp4, idx, wts, self.limit),
                               "experts_w2", rows=idx)
        if self.marlin is not None:
            return marlin_moe(xb, self.marlin, idx, wts, self.limit)
        if self.ogs is not None:  # no host sync: also inside captured decode steps
            return ogs_moe(xb, self.ogs, idx, wts, self.limit)
        return _ops().moe_mxfp4(xb, *self.mxfp4, idx, wts, self.limit)

    @property
    def _stacked(self) -> bool:
        """The routed experts run through a fused stack (Marlin's, matmul_ogs', ours), not the per-expert loop."""
        return self.marlin is not None or self.mxfp4 is not None or self.ogs is not None

    def takes_quantised_input(self, dtype: torch.dtype) -> bool:
        """Whether x of ``dtype`` may also arrive quantised per token (``QuantRows``, from the mHC collapse that makes
        it: ``dsv41::mhc_post_collapse_quant``) for the shared expert's fused ``[w1; w3]``, a ``w8a8`` GEMM that would
        quantise x itself, with x already in the experts' dtype (no cast before it)."""
        w13 = self.shared_experts.w13
        if w13 is None or dtype != self.act_dtype or not self._stacked:
            return False
        if self._x_rows_quantisable is None:
            self._x_rows_quantisable = reads_quantised_rows([w13], dtype, activation=True)
        return self._x_rows_quantisable

    def forward(self, x: torch.Tensor, ops: bool = False, xq: QuantRows | None = None,
                parts: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, H] -> [T, H]; ``xq``: x quantised per token as well (:meth:`takes_quantised_input`), for the shared
        expert's first GEMM.  ``parts``: (routed, shared) unsummed where the experts are stacked, for a reader that
        adds them itself (``dsv41::mhc_post``'s y2), else (the sum, None)."""
        if self._stacked:
            # bf16 into both expert paths (one cast, none with bf16 streams) and out (the mHC post-mix reads it)
            xb = x.to(self.act_dtype)
            shared_in = xq if xq is not None else xb
            # the shared expert on a side stream beside the router and the routed experts (model_executor/overlap)
            routed, shared = beside(xb, lambda: self.shared_experts(shared_in), lambda: self._routed(x, xb, ops))
            return (routed, shared) if parts else routed + shared
        idx, wts = self._route(x, ops)
        y = (masked_moe if in_static_step() else loop_moe)(x, self.experts, idx, wts, self.limit)
        y = y + self.shared_experts(x)
        return (y, None) if parts else y


class EngramTable(nn.Module):
    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = _param(rows, dim)


class Engram(nn.Module):
    """n-gram memory injected into the residual streams (§2.6)."""

    def __init__(self, cfg: DSV41Config, layer_id: int, wf: WeightFormat):
        super().__init__()
        k = cfg.engram_layer_ids.index(layer_id)
        C, H, hd = cfg.hc_mult, cfg.hidden_size, cfg.engram_head_dim
        self.embed = EngramTable(cfg.engram_num_embeddings[k], hd)
        self.wkv = QuantLinear((C + 1) * H, cfg.engram_n_columns * hd, wf.quant)
        self.q_weight = _param(C, H)
        self.k_weight = _param(C, H)
        self.layer_id, self.eps, self.C, self.H = layer_id, float(cfg.rms_norm_eps), C, H

    def forward(self, S: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        C, H = self.C, self.H
        kv = self.wkv(self.embed.weight[rows].flatten(1))
        keys, val = kv[:, :C * H].view(-1, C, H), kv[:, C * H:]
        dot = (S * (self.q_weight * self.k_weight) * keys).sum(-1)
        dot = dot * torch.rsqrt(S.pow(2).mean(-1) + self.eps) * torch.rsqrt(keys.pow(2).mean(-1) + self.eps)
        dot = dot / math.sqrt(H)
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
        return (S + gate.unsqueeze(-1) * val.unsqueeze(1)).to(S.dtype)  # the streams keep their dtype


# --------------------------------------------------------------------------- layers and model


@dataclass
class PendingPost:
    """A layer's FFN post-mix not yet applied (``dsv41::mhc_post`` of these): the next layer folds it into its first
    mHC boundary (``mhc_post_collapse`` / ``mhc_post_pre`` instead of ``mhc_post`` then ``mhc_collapse`` /
    ``mhc_pre``: one launch and one read of the streams fewer a layer); anything else that reads the streams applies it
    first (:func:`streams`)."""

    S: torch.Tensor
    y: torch.Tensor
    y2: torch.Tensor | None
    post: torch.Tensor
    comb: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.S.shape

    def apply(self) -> torch.Tensor:
        return _ops().mhc_post(self.S, self.y, self.post, self.comb, self.y2)


def streams(S: torch.Tensor | PendingPost) -> torch.Tensor:
    """The residual streams, a pending post-mix applied."""
    return S.apply() if isinstance(S, PendingPost) else S


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSV41Config, layer_id: int, prefix: str, bounded_replay: bool, wf: WeightFormat):
        super().__init__()
        plan = cfg.plan(layer_id)
        self.plan = plan
        H, C = cfg.hidden_size, cfg.hc_mult
        mix = (2 + C) * C
        self.attn_norm, self.ffn_norm = Norm(H), Norm(H)
        self.hc_attn_fn, self.hc_ffn_fn = _param(mix, C * H), _param(mix, C * H)
        self.hc_attn_base, self.hc_ffn_base = _param(mix), _param(mix)
        self.hc_attn_scale, self.hc_ffn_scale = _param(3), _param(3)
        self.attn = Attention(cfg, plan, f"{prefix}.attn", bounded_replay, wf)
        self.ffn = MoE(cfg, plan, wf)
        if plan.has_engram:
            self.engram = Engram(cfg, layer_id, wf)
        self.eps, self.hc_eps, self.iters = float(cfg.rms_norm_eps), float(cfg.hc_eps), cfg.hc_sinkhorn_iters

    def _coeffs(self, kind: str, S: torch.Tensor):
        return hc_coefficients(S, getattr(self, f"hc_{kind}_fn"), getattr(self, f"hc_{kind}_base"),
                               getattr(self, f"hc_{kind}_scale"), self.eps, self.hc_eps, self.iters)

    def forward(self, model: "DeepseekV41Model", step: Step, S: torch.Tensor | PendingPost, pre: torch.Tensor,
                tok: torch.Tensor, rows: torch.Tensor, floors: torch.Tensor, defer: bool = False):
        """S, pre for step tokens ``tok``; returns (S, pre) for ``tok[rows]``.  On the ops path S may arrive as the
        previous layer's :class:`PendingPost`, and with ``defer`` this layer's FFN post-mix leaves as one too."""
        if step.use_ops:
            return self._forward_ops(model, step, S, pre, tok, rows, floors, defer)
        S = streams(S)
        pre_a, post_a, comb_a = self._coeffs("attn", S)
        x = rms_norm(hc_collapse(S, pre), self.attn_norm.weight, self.eps)
        y = self.attn(model, step, x, tok, rows, floors)
        S = hc_post(S[rows], y, post_a[rows], comb_a[rows])
        pre_f, post_f, comb_f = self._coeffs("ffn", S)
        x = rms_norm(hc_collapse(S, pre_a[rows]), self.ffn_norm.weight, self.eps)
        return hc_post(S, self.ffn(x), post_f, comb_f), pre_f

    def _forward_ops(self, model: "DeepseekV41Model", step: Step, S: torch.Tensor | PendingPost, pre: torch.Tensor,
                     tok: torch.Tensor, rows: torch.Tensor, floors: torch.Tensor, defer: bool = False):
        """The same layer with the mHC boundaries as ops: ``mhc_pre`` (attention boundary),
        ``mhc_post_pre`` (attention post-mix + FFN boundary), ``mhc_post`` (FFN post-mix); up to
        ``mhc_op.split_rows()`` rows the split boundaries of :meth:`_forward_split`."""
        if S.shape[0] <= mhc_op.split_rows():
            return self._forward_split(model, step, S, pre, tok, rows, floors, defer)
        ops = _ops()
        args = (self.eps, self.hc_eps, self.iters)
        coeff_args = (self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, pre, self.attn_norm.weight, *args)
        if isinstance(S, PendingPost):  # the previous layer's FFN post-mix, folded in
            P = S
            S, x, pre_a, post_a, comb_a = ops.mhc_post_pre(P.S, P.y, P.post, P.comb, *coeff_args, P.y2)
        else:
            x, pre_a, post_a, comb_a = ops.mhc_pre(S, *coeff_args)
        y = self.attn(model, step, x, tok, rows, floors)
        S, x, pre_f, post_f, comb_f = ops.mhc_post_pre(step.take(S, rows), y, step.take(post_a, rows),
                                                       step.take(comb_a, rows), self.hc_ffn_fn,
                                                       self.hc_ffn_base, self.hc_ffn_scale, step.take(pre_a, rows),
                                                       self.ffn_norm.weight, *args)
        f, f2 = self._ffn_parts(x)
        return self._ffn_post(S, f, f2, post_f, comb_f, defer), pre_f

    @staticmethod
    def _ffn_post(S: torch.Tensor, f: torch.Tensor, f2: torch.Tensor | None, post: torch.Tensor, comb: torch.Tensor,
                  defer: bool) -> torch.Tensor | PendingPost:
        """The FFN boundary's post-mix, or (``defer``) the same left to the next layer."""
        if defer:
            return PendingPost(S, f, f2, post, comb)
        return _ops().mhc_post(S, f, post, comb, f2)

    def _ffn_parts(self, x: torch.Tensor, xq: QuantRows | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The FFN's output as ``dsv41::mhc_post``'s (y, y2): the MoE's routed and shared parts, which the post-mix
        adds (:func:`moe_add_in_post`), or their sum and None."""
        if moe_add_in_post():
            return self.ffn(x, ops=True, xq=xq, parts=True)
        return self.ffn(x, ops=True, xq=xq), None

    def _forward_split(self, model: "DeepseekV41Model", step: Step, S: torch.Tensor | PendingPost, pre: torch.Tensor,
                       tok: torch.Tensor, rows: torch.Tensor, floors: torch.Tensor, defer: bool = False):
        """:meth:`_forward_ops` with each boundary split (decode sizes): x from ``mhc_collapse`` /
        ``mhc_post_collapse`` (the previous boundary's pre-mix), the boundary's coefficients from ``mhc_coeffs`` on
        the side stream while the sublayer runs; the same numbers on the reference path.  Where a sublayer's first FP8
        GEMM takes pre-quantised rows, the collapse also quantises x per token in its normalising launch (the
        ``*_quant`` ops: the same x, and the codes that GEMM would have made of it)."""
        ops = _ops()
        args = (self.eps, self.hc_eps, self.iters)
        # xq, fq: x quantised in the collapse's own launch, where the sublayer's FP8 GEMM takes it (else None)
        P = S if isinstance(S, PendingPost) else None  # the previous layer's FFN post-mix, folded in
        S_in = P.S if P is not None else S
        quant = self.attn.takes_quantised_input(S_in.dtype)

        def attn_collapse():
            if P is not None:
                post_in = (P.S, P.y, P.post, P.comb, pre, self.attn_norm.weight, self.eps, P.y2)
                if quant:
                    S, x, *q = ops.mhc_post_collapse_quant(*post_in)
                    return S, x, QuantRows(*q, x.dtype)
                return *ops.mhc_post_collapse(*post_in), None
            if quant:
                x, *q = ops.mhc_collapse_quant(S_in, pre, self.attn_norm.weight, self.eps)
                return S_in, x, QuantRows(*q, x.dtype)
            return S_in, ops.mhc_collapse(S_in, pre, self.attn_norm.weight, self.eps), None

        qkv_a = self.attn.wqkv_a.weight_read(S_in.shape[0]) if self.attn.wqkv_a is not None else None
        S, x, xq = prefetching(S_in, qkv_a, attn_collapse, "qkv_a")
        y, (pre_a, post_a, comb_a) = beside(
            x, lambda: ops.mhc_coeffs(S, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, *args),
            lambda: self.attn(model, step, x, tok, rows, floors, xq=xq), lane=1)
        post_args = (step.take(S, rows), y, step.take(post_a, rows), step.take(comb_a, rows), step.take(pre_a, rows),
                     self.ffn_norm.weight, self.eps)

        def ffn_collapse():
            if self.ffn.takes_quantised_input(S.dtype):
                S_f, x, *q = ops.mhc_post_collapse_quant(*post_args)
                return S_f, x, QuantRows(*q, x.dtype)
            return *ops.mhc_post_collapse(*post_args), None

        w13 = self.ffn.shared_experts.w13
        S, x, fq = prefetching(y, w13.weight_read(y.shape[0]) if w13 is not None else None, ffn_collapse, "w13")
        (f, f2), (pre_f, post_f, comb_f) = beside(
            x, lambda: ops.mhc_coeffs(S, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, *args),
            lambda: self._ffn_parts(x, fq), lane=1)
        return self._ffn_post(S, f, f2, post_f, comb_f, defer), pre_f


def kept_rows_host(step: Step, window: int) -> torch.Tensor:
    """CED pruning (§3.2): the step rows the decoder layers run on, each request's last ``window`` rows (all of them
    for a request whose every row's logits are read), as host int64 indices (ascending), from the CPU metadata."""
    qsl = step.query_start_loc_cpu.tolist()
    trim = step.meta.trimmed(window).tolist()
    keep = [torch.arange(max(qsl[i], qsl[i + 1] - window) if trim[i] else qsl[i], qsl[i + 1])
            for i in range(step.num_reqs)]
    return torch.cat(keep) if keep else torch.arange(0)


def decoder_floors(step: Step, kept: torch.Tensor) -> torch.Tensor:
    """[num_reqs] on the step's device: the decoder layers' SWA floors (:func:`graphs.kept_floors`) when they keep
    the host rows ``kept``."""
    m = step.meta
    counts = torch.bincount(m.token_req_idx[kept], minlength=m.num_reqs)[:m.num_reqs]
    return host_to_device(kept_floors(m, counts), step.device)


def decoder_rows(step: Step, window: int, enabled: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the kept rows on the host (:func:`kept_rows_host`), the same on the step's device, moved once); (None, every
    row) when pruning is off.

    The one boundary between encoder and decoder: a graph split hooks here (:class:`graphs.DecoderGraphs`)."""
    if not enabled:
        return None, step.all_rows(step.num_tokens)
    kept = kept_rows_host(step, window)
    return kept, host_to_device(kept, step.device)


class DeepseekV41Model(nn.Module):
    def __init__(self, cfg: DSV41Config, bounded_replay: bool, wf: WeightFormat, prefix: str = ""):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, L, f"{prefix}layers.{L}", bounded_replay, wf) for L in range(cfg.n_layers))
        self.prune = bounded_replay and cfg.decoder_prunable
        self.decoder_graphs: DecoderGraphs | None = None  # set by the causal LM (prefill_graph_mode)
        self.decoder_graph_mode = "off"
        self.decoder_carry = decoder_carry_keys(cfg) if self.prune else []
        self._engram = engram_math.engram_hashing_from_config(cfg) if cfg.engram_layer_ids else None
        self._engram_consts: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}  # engram_rows'
        self.history_requests = 0  # rows of the token history (backend.history_capacity); set by the causal LM
        self._history: TokenHistory | None = None

    def set_token_map(self, cmap: torch.Tensor) -> None:
        self._cmap = cmap
        self._cmap_pad = None
        self._cmap_dev = {}

    def _token_map(self, device: torch.device) -> torch.Tensor:
        m = self._cmap_dev.get(device)
        if m is None:
            m = self._cmap_dev[device] = self._cmap.to(device)
        return m

    def engram_rows(self, step: Step, layer_id: int) -> torch.Tensor:
        def make() -> torch.Tensor:
            h = self._engram
            win = step.token_windows(h.max_ngram, self._token_history(step.device))
            cmap = self._token_map(win.device)
            cids = torch.where(win >= 0, cmap[win.clamp(min=0)], torch.full_like(win, -1))
            if self._cmap_pad is None:
                self._cmap_pad = int(self._cmap[h.pad_token_id])
            key = (layer_id, cids.device)
            if key not in self._engram_consts:  # first (eager) step on this device, never inside a capture
                self._engram_consts[key] = engram_math.row_id_constants(h.layout(layer_id), h.mult(layer_id),
                                                                        cids.device)
            return engram_math.row_ids_from(cids, self._engram_consts[key], self._cmap_pad)

        return step.once(("engram", layer_id), make)

    def _token_history(self, device: torch.device) -> TokenHistory | None:
        """The device token history (made on the first eager step, never inside a capture), None without rows."""
        if self.history_requests and (self._history is None or self._history.ids.device != device):
            self._history = TokenHistory(self.history_requests, device)
        return self._history

    def attn_of(self, layer_id: int) -> Attention:
        return self.layers[layer_id].attn

    def index_view(self, step: Step, src: Attention, n_max: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """What ``dsv41::index_scores`` reads for KV source ``src``: (flat index-K cache, table,
        rows_per_block).  With dense cache blocks that is the group's block table; otherwise
        (packed pool, see ``CacheLayer.flat_rows``) a per-step table of every entry's flat row
        ([num_reqs, n_max], rows_per_block 1), built once per step and source."""
        cache = src.index_cache
        flat, bstep, rstep = cache.flat_rows()
        g = step.group(cache.prefix)
        if bstep == g.rows_per_block and rstep == 1:
            return flat, g.block_table_i32, g.rows_per_block
        table = step.once(("index_table", cache.prefix, n_max), lambda: g.slots_of(
            step.all_rows(step.num_reqs), torch.arange(n_max, device=step.device).expand(step.num_reqs, n_max),
            (bstep, rstep)))
        return flat, table, 1

    def forward(self, step: Step, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        T = S.shape[0]
        dev = S.device
        tok = step.all_rows(T)
        pre = torch.zeros(T, cfg.hc_mult, device=dev)
        pre[:, 0] = 1.0
        kept_host, kept = decoder_rows(step, cfg.sliding_window,
                                       self.prune and step.needs_pruning(cfg.sliding_window))
        base_floor = step.replay_start
        graphs = self.decoder_graphs if self.prune and not in_static_step() else None
        if graphs is not None and not graphs.accepts(step.meta, T if kept_host is None else kept_host.numel()):
            graphs = None
        elif graphs is not None and kept_host is None:
            # nothing to trim (a mixed step of short chunks beside decode rows): every row kept, so the decoder layers
            # still run as the captured static step
            kept_host, kept = torch.arange(T), tok
        defer = step.use_ops and fold_post()  # each FFN post-mix folded into the next layer's first boundary
        for L, layer in enumerate(self.layers):
            plan = layer.plan
            if graphs is not None and L == cfg.boundary_layer + 1:
                carry = {k: step.scratch[k] for k in self.decoder_carry if k in step.scratch}
                if all(t.shape[0] == kept_host.numel() for t in carry.values()):
                    S = streams(S)
                    S, pre = graphs.run(step.meta, kept_host, kept, S, pre, carry, S.device,
                                        capture=self.decoder_graph_mode == "capture")
                    return S, pre, tok
            if plan.has_engram:
                S = layer.engram(streams(S), step.take(self.engram_rows(step, L), tok))
            rows = step.all_rows(tok.numel())
            floors = base_floor
            if kept_host is not None and L == cfg.boundary_layer:
                rows = kept  # KV pass on every row, attention + MoE on the kept rows
            elif kept_host is not None and plan.is_decoder:  # one tensor for every decoder layer (caches key on it)
                floors = step.once("decoder_floors", lambda: decoder_floors(step, kept_host))
            S, pre = layer(self, step, S, pre, tok, rows, floors, defer=defer)
            tok = step.take(tok, rows)
        return streams(S), pre, tok


def decoder_carry_keys(cfg: DSV41Config) -> list:
    """The per-step results (``Step.scratch`` keys) that decoder layers read from layers up to the boundary: the
    top-k ids of index sources there, and the candidate blocks when a decoder layer consumes them."""
    b, keys = cfg.boundary_layer, []
    for L in range(b + 1, cfg.n_layers):
        p = cfg.plan(L)
        if p.compress_ratio > 0 and p.index_source is not None and p.index_source <= b:
            keys.append(("topk_ids", p.index_source))
        if p.is_candidate_consumer and any(cfg.plan(i).is_candidate_source for i in range(b + 1)):
            keys.append("cand_blocks")
    return list(dict.fromkeys(keys))


def _run_decoder(model: DeepseekV41Model, step: Step, S: torch.Tensor, pre: torch.Tensor, carry: dict
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers (after the boundary) over a step whose rows are the kept rows (``graphs.kept_step_meta``):
    every row of it, with the decoder floors the eager loop uses, made from the step's own tensors, and ``carry``
    (:func:`decoder_carry_keys`) in the step's scratch."""
    cfg = model.cfg
    step.scratch.update(carry)
    rows = step.all_rows(S.shape[0])
    floors = step.replay_start  # kept_step_meta's: each request's decoder floor (graphs.kept_floors)
    defer = step.use_ops and fold_post()
    for layer in model.layers[cfg.boundary_layer + 1:]:
        S, pre = layer(model, step, S, pre, rows, rows, floors, defer=defer)
    return streams(S), pre


def _compressed_token_map(vllm_config, cfg: DSV41Config) -> torch.Tensor:
    """Engram's normalised token map, built from the served tokenizer and checked against the config."""
    from transformers import AutoTokenizer

    mc = vllm_config.model_config
    tok = AutoTokenizer.from_pretrained(mc.tokenizer, revision=mc.tokenizer_revision,
                                        trust_remote_code=mc.trust_remote_code)
    cmap, n = engram_math.build_compressed_token_map(tok)
    if n != cfg.engram_compressed_vocab_size:
        raise ValueError(f"config key 'engram_compressed_vocab_size' is {cfg.engram_compressed_vocab_size}, but "
                         f"the tokenizer at {mc.tokenizer} normalises to {n} ids")
    return torch.as_tensor(cmap, dtype=torch.long)


class DeepseekV41ForCausalLM(nn.Module):
    """vLLM entry class for architecture ``DeepseekV41ForCausalLM`` (text path)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        self.vllm_config = vllm_config
        self.cfg = from_hf_config(vllm_config.model_config.hf_config)
        self.bounded_replay = not exact_mode()
        self.ops_mode = ops_mode()
        sparse_attn_gathered.mode()  # a misspelt VLLM_DSV41_PREFILL_ATTN fails the engine start, not a request
        sparse_attn_gathered.decode_mode()  # the same for VLLM_DSV41_DECODE_ATTN
        mhc_op.gemm_from()  # the same for VLLM_DSV41_MHC_GEMM_FROM
        mhc_op.split_rows()  # and VLLM_DSV41_MHC_SPLIT_ROWS
        fused_quant()  # and VLLM_DSV41_FUSED_QUANT
        fused_act_quant()  # and VLLM_DSV41_FUSED_ACT_QUANT
        cfg = self.cfg
        self.weights = WeightFormat.choose(exact_mode())
        wf = self.weights
        self.stream_dtype = stream_dtype(wf)
        self.embed = Norm(1)
        self.embed.weight = _param(cfg.vocab_size, cfg.hidden_size, dtype=wf.dense_dtype)
        self.model = DeepseekV41Model(cfg, self.bounded_replay, wf, prefix=f"{prefix}.model." if prefix else "model.")
        self.norm = Norm(cfg.hidden_size)
        self.head = Dense(cfg.vocab_size, cfg.hidden_size, wf.dense_dtype)
        if cfg.engram_layer_ids:
            self.model.set_token_map(_compressed_token_map(vllm_config, cfg))
            self.model.history_requests = history_capacity(vllm_config.scheduler_config.max_num_seqs)
        self.user_eager = user_asked_eager(vllm_config)  # enforce_eager from the user: no graphs unless asked by name
        self._graph_mode: str | None = None  # decided on the first step (graphs.graph_mode)
        self._graphs: DecodeGraphs | None = None
        self._prefill_graph_mode: str | None = None  # the same for the prefill decoder graphs
        prefill_graph_mode(torch.device("cpu"), True)  # a misspelt VLLM_DSV41_PREFILL_GRAPHS fails the start
        self._mixed_graph_mode: str | None = None  # and for the mixed steps' graphs
        self._mixed: MixedGraphs | None = None
        mixed_graph_mode(torch.device("cpu"), True)  # the same for VLLM_DSV41_MIXED_GRAPHS

    # vLLM model interface -------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed.weight[input_ids]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        cfg = self.cfg
        given = input_ids if input_ids is not None else inputs_embeds
        dev, T = given.device, given.shape[0]
        meta = current_step()
        out = torch.zeros(T, cfg.hidden_size, dtype=torch.float32, device=dev)
        if meta is None or meta.num_tokens == 0 or meta.num_tokens > T:  # profile / dummy run: no caches
            if dev.type == "cuda":
                self._reserve_activations(T, dev)
            return out
        n = meta.num_tokens  # rows past n are the runner's padding
        ops = use_ops(self.ops_mode, dev)
        graphs = self._decode_graphs(dev, ops) if inputs_embeds is None else None
        if graphs is not None and graphs.accepts(meta):
            out[:n] = graphs.run(meta, input_ids, dev, capture=self._graph_mode == "capture")
            return out
        mixed = self._mixed_graphs(dev, ops) if inputs_embeds is None else None
        if mixed is not None and mixed.accepts(meta):
            out[:n] = mixed.run(meta, input_ids, dev, capture=self._mixed_graph_mode == "capture")
            return out
        self._prefill_decoder_graphs(dev, ops)
        step = Step(meta, input_ids[:n] if input_ids is not None else None, device=dev, use_ops=ops)
        e = inputs_embeds[:n] if inputs_embeds is not None else self.embed_input_ids(input_ids[:n])
        h, tok = self._final_hidden(step, e)
        out[tok] = h  # rows the decoder skipped stay zero; only each request's last row is sampled
        return out

    def activation_bytes(self, T: int) -> int:
        """Upper estimate of a T-token step's transient activations (bytes), for the profile run.

        Per token: the query path in fp32 and bf16 (q, its RoPE copy, the attention output, the Marlin
        input/output casts: ~5 x heads x head_dim x 4), the mHC streams (3 copies of hc x hidden x 4) and the
        routed experts' intermediates (top-k x (2I + I + H) x 2); and the indexer's selection at the longest context
        (max_model_len / smallest ratio entries a row), :data:`INDEX_BYTES_PER_ENTRY` a (row, entry) over the rows of
        one of its passes (:func:`index_chunk_rows`)."""
        cfg = self.cfg
        per_tok = (5 * cfg.num_attention_heads * cfg.head_dim * 4 + 3 * cfg.hc_mult * cfg.hidden_size * 4
                   + cfg.num_experts_per_tok * (3 * cfg.moe_intermediate_size + cfg.hidden_size) * 2)
        ratios = [r for r in cfg.compress_ratios if r > 0] or [1]
        entries = self.vllm_config.model_config.max_model_len // min(ratios)
        return T * per_tok + min(T, index_chunk_rows(entries)) * INDEX_BYTES_PER_ENTRY * entries

    def _reserve_activations(self, T: int, dev: torch.device) -> None:
        """vLLM sizes the KV cache from the profile run's peak memory, but that run has no caches and our
        forward returns at once; holding :meth:`activation_bytes` for a moment makes the peak what a real
        step of T tokens needs, so a long prefill does not run out of memory next to a full KV pool.  With
        ``kv_cache_memory_bytes`` the user sized the pool and vLLM does not read the profile run's peak (its dummy runs
        only compile and warm up, the later ones beside the allocated pool), so an estimate that does not fit is a
        warning there, not a refused start: the estimate is an upper bound (2.4x a 64k prompt's measured peak on an
        H100, docs/benchmarks.md "Session 30")."""
        nbytes = self.activation_bytes(T)
        try:
            torch.empty(nbytes, dtype=torch.uint8, device=dev)  # freed at once: the peak is what counts
        except torch.OutOfMemoryError as e:
            mc, sc = self.vllm_config.model_config, self.vllm_config.scheduler_config
            msg = (f"vllm-dsv41: a {T}-token step needs ~{nbytes / 2**30:.2f} GiB of activations beside the weights "
                   f"(max_num_batched_tokens={sc.max_num_batched_tokens}, max_model_len={mc.max_model_len}), and they "
                   f"do not fit on this GPU; lower max_num_batched_tokens or max_model_len, or leave more memory free "
                   f"(kv_cache_memory_bytes / gpu_memory_utilization)")
            if self.vllm_config.cache_config.kv_cache_memory_bytes:
                if not getattr(self, "_reservation_warned", False):  # once: warm-up runs the dummy step repeatedly
                    logger.warning("%s (an upper estimate; the KV pool is the user's kv_cache_memory_bytes, so the "
                                   "engine starts, and the longest prefill steps may run out of memory)", msg)
                    self._reservation_warned = True
                return
            raise torch.OutOfMemoryError(msg) from e

    def _final_hidden(self, step: Step, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings [n, H] of the step's tokens -> (final hidden states of the rows the decoder kept, those
        rows' token indices)."""
        cfg = self.cfg
        S = e.to(self.stream_dtype)[:, None, :].expand(e.shape[0], cfg.hc_mult, cfg.hidden_size).contiguous()
        S, pre, tok = self.model(step, S)
        return rms_norm(hc_collapse(S, pre), self.norm.weight, float(cfg.rms_norm_eps)), tok

    def _static_hidden(self, step: Step) -> torch.Tensor:
        """The final hidden states of a static step's every row, from its token ids (what both graph sets capture)."""
        return self._final_hidden(step, self.embed_input_ids(step.input_ids))[0]

    def _decode_graphs(self, device: torch.device, ops: bool) -> DecodeGraphs | None:
        """The decode-step graphs (``graphs.py``), made on the first step; None when off."""
        if self._graph_mode is None:
            self._graph_mode = graph_mode(device, ops, self.user_eager)
            if self._graph_mode != "off":
                sc, mc = self.vllm_config.scheduler_config, self.vllm_config.model_config
                self._graphs = DecodeGraphs(self._static_hidden, max_batch=min(sc.max_num_seqs, 512),
                                            max_context=mc.max_model_len)
        return self._graphs

    def _mixed_graphs(self, device: torch.device, ops: bool) -> MixedGraphs | None:
        """The mixed steps' graphs (``graphs.MixedGraphs``: short chunks beside decode rows, whole), made on the first
        step; None when off."""
        if self._mixed_graph_mode is None:
            self._mixed_graph_mode = mixed_graph_mode(device, ops, self.user_eager)
            if self._mixed_graph_mode != "off":
                sc, mc = self.vllm_config.scheduler_config, self.vllm_config.model_config
                self._mixed = MixedGraphs(self._static_hidden, max_batch=min(sc.max_num_seqs, 512),
                                          max_context=mc.max_model_len, window=self.cfg.sliding_window)
        return self._mixed

    def _prefill_decoder_graphs(self, device: torch.device, ops: bool) -> None:
        """The decoder-layer graphs of prefill steps (``graphs.DecoderGraphs``), set on the model on the first step
        when ``VLLM_DSV41_PREFILL_GRAPHS`` asks for them."""
        if self._prefill_graph_mode is not None:
            return
        m = self.model
        mode = self._prefill_graph_mode = prefill_graph_mode(device, ops, self.user_eager)
        if mode != "off" and m.prune:
            mc, sc = self.vllm_config.model_config, self.vllm_config.scheduler_config
            max_rows = self.cfg.sliding_window * min(sc.max_num_seqs, 512)
            m.decoder_graphs = DecoderGraphs(functools.partial(_run_decoder, m), max_rows=max_rows,
                                             max_context=mc.max_model_len, window=self.cfg.sliding_window)
            m.decoder_graph_mode = mode

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.head(hidden_states.float())

    def process_weights_after_loading(self) -> None:
        """vLLM's model-level hook after loading (checkpoint or dummy): quantised weights on CUDA are
        repacked for Marlin (:mod:`~vllm_dsv41.model_executor.linear`)."""
        for m in list(self.modules()):
            if hasattr(m, "finalize"):
                m.finalize()

    # weights ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm_dsv41.model_executor.loader import load_dsv41_weights

        return load_dsv41_weights(self, weights, draft=False)
