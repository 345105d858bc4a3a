"""Exact plain-PyTorch DeepSeek-V4.1-Flash: the oracle for every test.

Owns the whole forward pass of architecture.md §2 (embedding, delayed mHC with
Sinkhorn, CSA2 attention with compressors, indexer, candidate blocks and sink,
MoE, Engram, final collapse) and the DSpark draft of §5, written to be read
top to bottom.  One request at a time, fp32 throughout, weights dequantised at
load.  A :class:`Session` holds one request's caches and supports incremental
decoding, chunked prefill, the engine's cache-record quantisation
(``cache_quant``), decoder-side pruning (``prune``) and bounded replay after a
prefix hit (``replay_start``), so the vLLM model can be compared token for token.

Attention is computed densely with masks (every visible key, masked to the
sliding window and the selected compressed entries): slower than gathering, but
plainly equal to the definition.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm_dsv41 import engram as engram_math
from vllm_dsv41 import formats
from vllm_dsv41.checkpoint import Checkpoint, open_checkpoint
from vllm_dsv41.config import DSV41Config, LayerPlan, RopeParams

# --------------------------------------------------------------------------- math helpers


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * w if w is not None else y


def rope_inv_freq(rope: RopeParams, dim: int) -> torch.Tensor:
    """Per-pair inverse frequencies, with YaRN interpolation when factor > 1 (no mscale)."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rope.yarn_factor > 1.0 and rope.original_max_position > 0:
        def corr(rot: float) -> float:
            return dim * math.log(rope.original_max_position / (rot * 2 * math.pi)) / (2 * math.log(rope.theta))

        lo = max(math.floor(corr(rope.beta_fast)), 0)
        hi = min(math.ceil(corr(rope.beta_slow)), dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
        keep = 1 - ramp  # 1 = high-frequency pair, left unscaled
        inv = inv / rope.yarn_factor * (1 - keep) + inv * keep
    return inv.float()


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, R/2] (fp32, angles in float64) of positions ``pos``."""
    ang = pos.double()[:, None] * inv_freq.double()[None, :]  # [T, R/2]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False,
               cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """GPT-J (interleaved pairs) rotation of the last ``2*len(inv_freq)`` dims of x [T, ..., d].
    ``cos_sin``: :func:`rope_cos_sin` of ``pos``, when the caller already has it."""
    R = inv_freq.numel() * 2
    cos, sin = cos_sin if cos_sin is not None else rope_cos_sin(pos, inv_freq)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (R // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    rot = x[..., -R:].unflatten(-1, (R // 2, 2))
    a, b = rot[..., 0], rot[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-R], out), dim=-1)


def hc_coefficients(S: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC boundary (§2.3): S [T, C, H] -> pre [T, C], post [T, C], comb [T, C, C] (row = source)."""
    T, C, _ = S.shape
    v = S.flatten(1)
    m = (v @ fn.t()) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    pre = torch.sigmoid(scale[0] * m[:, :C] + base[:C]) + hc_eps
    post = 2.0 * torch.sigmoid(scale[1] * m[:, C:2 * C] + base[C:2 * C])
    logits = (scale[2] * m[:, 2 * C:] + base[2 * C:]).view(T, C, C)
    return pre, post, sinkhorn(logits, hc_eps, iters)


def sinkhorn(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """Softmax over rows, then alternate column/row normalisation (first step: columns only)."""
    A = torch.softmax(logits, dim=-1) + eps
    A = A / (A.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        A = A / (A.sum(-1, keepdim=True) + eps)
        A = A / (A.sum(-2, keepdim=True) + eps)
    return A


def hc_collapse(S: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * S).sum(1)


def hc_post(S: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """S_new[j] = sum_i comb[i, j] * S[i] + post[j] * y."""
    return torch.einsum("tij,tih->tjh", comb, S) + post.unsqueeze(-1) * y.unsqueeze(1)


def route(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, k: int,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sqrtsoftplus router: select top-k of (s + bias), weight by unbiased s renormalised, times scaling once."""
    s = torch.sqrt(F.softplus(x @ gate_w.t()))
    idx = top_indices(s + bias, k)
    w = s.gather(-1, idx)
    return idx, w / w.sum(-1, keepdim=True) * scaling


def clamped_swiglu_act(a: torch.Tensor, b: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(a, L)) * clamp(b, -L, L): the gate and up projections' activation."""
    return F.silu(a.clamp(max=limit)) * b.clamp(-limit, limit)


def swiglu_clamped(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    return clamped_swiglu_act(x @ w1.t(), x @ w3.t(), limit) @ w2.t()


def sparse_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q [T, h, D], keys [N, D] (K = V), mask [T, N] bool, sink [h] -> out [T, h, D]; sink adds exp(sink) to the denominator.

    Accumulates in float64 and rounds once to q's dtype, so the result does not depend on the order of the
    keys nor on masked keys: the dense masked layout here, the engine's per-request layout and the
    union-of-listed-slots layout of ``ops.sparse_attn_ref`` give the same fp32 bits (in fp32 the summation
    order alone moves ~80% of the outputs by an ulp, and a quantised cache record downstream can turn
    that into a different token).
    """
    qd, kd, sd = q.double(), keys.double(), sink.double()
    logits = torch.einsum("thd,nd->thn", qd, kd) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    m = torch.maximum(logits.amax(-1), sd[None, :])  # [T, h]
    p = torch.exp(logits - m[..., None])
    denom = p.sum(-1) + torch.exp(sd[None, :] - m)
    return torch.einsum("thn,nd->thd", p / denom[..., None], kd).to(q.dtype)


def index_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Indexer logits I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]).  q [T, h, d], w [T, h], k [N, d]."""
    return torch.einsum("th,thn->tn", w, torch.relu(torch.einsum("thd,nd->thn", q, k)))


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row; equal scores go to the lower index (a rule every
    implementation must share: the indexer's ReLU makes exact ties common)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def candidate_mask(scores: torch.Tensor, n_vis: torch.Tensor, block: int, n_blocks: int) -> torch.Tensor:
    """Candidate source (§2.5.5): keep the best ``n_blocks`` blocks per row by block max; the block of the
    newest visible entry is always kept.  scores [T, N] (-inf beyond n_vis) -> bool mask [T, N]."""
    T, N = scores.shape
    if N == 0:
        return torch.zeros(T, 0, dtype=torch.bool, device=scores.device)
    nb = -(-N // block)
    padded = F.pad(scores, (0, nb * block - N), value=float("-inf"))
    bmax = padded.view(T, nb, block).amax(-1)
    newest = ((n_vis - 1).clamp(min=0) // block).long()
    dev = scores.device
    bmax[torch.arange(T, device=dev), newest] = float("inf")
    valid_blocks = (torch.arange(nb, device=dev)[None, :] * block) < n_vis[:, None]
    bmax = bmax.masked_fill(~valid_blocks, float("-inf"))
    keep = torch.zeros(T, nb, dtype=torch.bool, device=dev)
    top = top_indices(bmax, min(n_blocks, nb))
    keep.scatter_(1, top, True)
    keep &= valid_blocks
    return keep.repeat_interleave(block, dim=1)[:, :N]


def topk_select(scores: torch.Tensor, n_vis: torch.Tensor, topk: int) -> torch.Tensor:
    """bool mask [T, N] of the selected entries: all visible when n_vis <= topk, else the top-k scores."""
    T, N = scores.shape
    vis = torch.arange(N, device=scores.device)[None, :] < n_vis[:, None]
    sel = vis.clone()
    big = n_vis > topk
    if big.any() and N > topk:
        idx = top_indices(scores[big], topk)
        m = torch.zeros(int(big.sum()), N, dtype=torch.bool, device=scores.device)
        m.scatter_(1, idx, True)
        sel[big] = m & vis[big]
    return sel


# --------------------------------------------------------------------------- weights


@dataclass
class Options:
    """How the reference computes: engine-equal cache records, replay and pruning."""

    cache_quant: bool = True  # store SWA as MXFP8, compressed KV as NVFP4, index K as MXFP4 (fake-quant)


class Weights:
    """All weights of one checkpoint, dequantised to fp32, addressed by checkpoint name."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self._cache: dict[str, torch.Tensor] = {}

    def __call__(self, name: str) -> torch.Tensor:
        """A linear's weight (``name`` without ``.weight``) or a raw tensor (full name)."""
        t = self._cache.get(name)
        if t is None:
            if f"{name}.weight" in self.ckpt:
                t = self.ckpt.dense(name)
            else:
                t = self.ckpt.get(name).float()
            self._cache[name] = t
        return t

    def engram_table(self, prefix: str) -> torch.Tensor:
        key = f"{prefix}.embed(table)"
        if key not in self._cache:
            self._cache[key] = self.ckpt.engram_table(prefix)
        return self._cache[key]


# --------------------------------------------------------------------------- model


@dataclass
class Session:
    """One request's state: token history and every cache, indexed by absolute position/entry."""

    tokens: list[int] = field(default_factory=list)
    swa: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [P, D] (rotated, record-quantised)
    comp: dict[int, torch.Tensor] = field(default_factory=dict)  # source layer -> [P // r, D]
    idxk: dict[int, torch.Tensor] = field(default_factory=dict)  # source layer -> [P // r, ID]
    kv_score: dict[int, torch.Tensor] = field(default_factory=dict)  # ratio-2 source -> [P, 2D] compressor input
    aux: torch.Tensor | None = None  # [P, n_targets, H] DSpark features (means over streams)
    draft_swa: dict[int, torch.Tensor] = field(default_factory=dict)  # draft layer -> [P, D]

    @property
    def length(self) -> int:
        return len(self.tokens)


def _grow(buf: torch.Tensor | None, n: int, width: int) -> torch.Tensor:
    if buf is None:
        return torch.zeros(max(n, 64), width)
    if buf.shape[0] >= n:
        return buf
    return torch.cat((buf, torch.zeros(max(n, 2 * buf.shape[0]) - buf.shape[0], width)))


@dataclass
class _Step:
    """Per-forward bookkeeping shared by the layers of one chunk."""

    pos: torch.Tensor  # [T] absolute positions of the chunk
    swa_floor: int
    write_global_from: int  # compressed/index entries of tokens below this position are kept as cached
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # index layer -> bool mask [T, N]
    cand: torch.Tensor | None = None  # candidate mask of the candidate source [T, N]


class Transformer:
    """DeepSeek-V4.1 backbone + DSpark draft, computing in fp32."""

    def __init__(self, path: str | os.PathLike, options: Options | None = None, validate: bool = True):
        self.ckpt = open_checkpoint(path, validate=validate)
        self.cfg: DSV41Config = self.ckpt.cfg
        self.w = Weights(self.ckpt)
        self.opt = options or Options()
        c = self.cfg
        self.eps = float(c.rms_norm_eps)
        self._inv_freq = {p.layer_id: rope_inv_freq(p.rope, c.qk_rope_head_dim) for p in c.plans}
        self._cmap = None
        if c.engram_layer_ids:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(os.fspath(path))
            cmap, n = engram_math.build_compressed_token_map(tok)
            if n != c.engram_compressed_vocab_size:
                raise ValueError(f"config key 'engram_compressed_vocab_size' is {c.engram_compressed_vocab_size}, "
                                 f"but the tokenizer's normalised map has {n} ids")
            self._cmap = torch.as_tensor(cmap, dtype=torch.long)
            self._layouts = engram_math.engram_layout(c.engram_layer_ids, c.engram_max_ngram_size,
                                                      c.engram_n_heads, c.engram_vocab_size)
            self._mults = [torch.as_tensor(engram_math.hash_multipliers(L, c.engram_max_ngram_size, n))
                           for L in c.engram_layer_ids]
            self._pad_cid = int(self._cmap[c.engram_pad_token_id])

    # ------------------------------------------------------------ quantisation of cache records
    def _q(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return formats.fake_quant(x, kind) if self.opt.cache_quant else x

    # ------------------------------------------------------------ Engram (§2.6)
    def engram_rows(self, tokens: list[int], pos: torch.Tensor, layer_id: int) -> torch.Tensor:
        c = self.cfg
        cids = self._cmap[torch.as_tensor(tokens, dtype=torch.long)]
        win = engram_math.lookback_windows(cids, pos, c.engram_max_ngram_size)
        k = c.engram_layer_ids.index(layer_id)
        return engram_math.engram_row_ids(win, self._layouts[k], self._mults[k], self._pad_cid)

    def engram(self, p: str, S: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        c, w = self.cfg, self.w
        emb = w.engram_table(f"{p}.engram")[rows].flatten(1)  # [T, cols * hd]
        kv = emb @ w(f"{p}.engram.wkv").t()  # [T, (C+1) H]
        C, H = c.hc_mult, c.hidden_size
        keys, val = kv[:, :C * H].view(-1, C, H), kv[:, C * H:]
        qk = w(f"{p}.engram.q_weight") * w(f"{p}.engram.k_weight")  # [C, H]
        dot = (S * qk * keys).sum(-1)
        dot = dot * torch.rsqrt(S.pow(2).mean(-1) + self.eps) * torch.rsqrt(keys.pow(2).mean(-1) + self.eps)
        dot = dot / math.sqrt(H)
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
        return S + gate.unsqueeze(-1) * val.unsqueeze(1)

    # ------------------------------------------------------------ attention (§2.5)
    def _compress(self, s: Session, p: str, plan: LayerPlan, x: torch.Tensor, st: _Step) -> None:
        """KV source: compressor + compressed-KV and index-K entries closed by this chunk."""
        c, w, L = self.cfg, self.w, plan.layer_id
        r, D = plan.compress_ratio, c.head_dim
        kv_c = x @ w(f"{p}.attn.compressor.wkv").t()
        end = int(st.pos[-1]) + 1
        first = int(st.pos[0])
        if r == 2:
            score = x @ w(f"{p}.attn.compressor.wgate").t()
            buf = _grow(s.kv_score.get(L), end, 2 * D)
            buf[first:end] = torch.cat((kv_c, score), -1)
            s.kv_score[L] = buf
        n_end = end // r
        s.comp[L] = _grow(s.comp.get(L), n_end, D)
        s.idxk[L] = _grow(s.idxk.get(L), n_end, c.index_head_dim)
        # entries j whose closing token (j+1)r-1 lies in this chunk [first, end)
        js = list(range((first + r) // r - 1, end // r))
        if not js:
            return
        jt = torch.as_tensor(js)
        if r == 2:
            pair = s.kv_score[L][torch.stack((2 * jt, 2 * jt + 1), 1)]  # [J, 2, 2D]
            kvp, sc = pair[..., :D], pair[..., D:]
            pooled = (kvp * torch.softmax(sc, dim=1)).sum(1)
        else:
            pooled = kv_c[jt - first]
        z = rms_norm(pooled, w(f"{p}.attn.compressor.norm.weight"), self.eps)
        ent_pos = jt * r
        z_rot = apply_rope(z, ent_pos, self._inv_freq[L])
        k_idx = rms_norm(z @ w(f"{p}.attn.indexer.wk.weight").t(), w(f"{p}.attn.indexer.k_norm.weight"), self.eps)
        k_idx = apply_rope(k_idx, ent_pos, self._inv_freq[L])
        keep = (jt + 1) * r - 1 >= st.write_global_from
        s.comp[L][jt[keep]] = self._q(z_rot[keep], "nvfp4")
        s.idxk[L][jt[keep]] = self._q(k_idx[keep], "mxfp4")

    def _select(self, s: Session, p: str, plan: LayerPlan, x: torch.Tensor, qr: torch.Tensor,
                rows: torch.Tensor, st: _Step) -> torch.Tensor:
        """Indexer of an index-source layer: bool mask [T', N] of selected compressed entries."""
        c, w, L = self.cfg, self.w, plan.layer_id
        pos = st.pos[rows]
        n_vis = (pos + 1) // plan.compress_ratio
        N = int(n_vis.max())
        keys = s.idxk[plan.kv_source][:N]
        qi = (qr @ w(f"{p}.attn.indexer.wq_b").t()).view(-1, c.index_n_heads, c.index_head_dim)
        qi = apply_rope(qi, pos, self._inv_freq[L])
        wts = (x @ w(f"{p}.attn.indexer.weights_proj.weight").t()) * (c.index_head_dim ** -0.5) * (c.index_n_heads ** -0.5)
        scores = index_scores(qi, wts, keys)
        vis = torch.arange(N)[None, :] < n_vis[:, None]
        scores = scores.masked_fill(~vis, float("-inf"))
        if plan.is_candidate_source:
            st.cand = candidate_mask(scores, n_vis, c.candidate_block_size, c.candidate_topk_blocks)
        elif plan.is_candidate_consumer and st.cand is not None:
            cand = st.cand[:, :N]
            return topk_select(scores.masked_fill(~cand, float("-inf")), n_vis, c.index_topk) & cand
        return topk_select(scores, n_vis, c.index_topk)

    def attention(self, s: Session, p: str, plan: LayerPlan, x: torch.Tensor, rows: torch.Tensor,
                  st: _Step, floor: int, kv_rows_all: bool) -> torch.Tensor:
        """CSA2 sublayer.  ``x`` holds every row whose KV is written; attention output only for ``rows``."""
        c, w, L = self.cfg, self.w, plan.layer_id
        D, Hn = c.head_dim, c.num_attention_heads
        pos_all = st.pos if kv_rows_all else st.pos[rows]
        qr_all = rms_norm(x @ w(f"{p}.attn.wq_a").t(), w(f"{p}.attn.q_norm.weight"), self.eps)
        kv = rms_norm(x @ w(f"{p}.attn.wkv").t(), w(f"{p}.attn.kv_norm.weight"), self.eps)
        kv = apply_rope(kv, pos_all, self._inv_freq[L])
        end = int(st.pos[-1]) + 1
        buf = _grow(s.swa.get(L), end, D)
        buf[pos_all] = self._q(kv, "mxfp8")
        s.swa[L] = buf
        if plan.owns_compressor:
            self._compress(s, p, plan, x, st)
        xr = x[rows] if kv_rows_all else x
        qr = qr_all[rows] if kv_rows_all else qr_all
        pos = st.pos[rows]
        if plan.owns_indexer and plan.compress_ratio > 0:
            st.topk[L] = self._select(s, p, plan, xr, qr, rows, st)
        q = (qr @ w(f"{p}.attn.wq_b").t()).view(-1, Hn, D)
        q = apply_rope(q, pos, self._inv_freq[L])
        # keys: SWA positions [lo, end) then compressed entries [0, N)
        lo = max(int(pos.min()) - c.sliding_window + 1, floor, 0)
        swa_keys = s.swa[L][lo:end]
        kp = torch.arange(lo, end)
        swa_mask = (kp[None, :] <= pos[:, None]) & (kp[None, :] > pos[:, None] - c.sliding_window) & (kp[None, :] >= floor)
        keys, mask = swa_keys, swa_mask
        if plan.compress_ratio > 0:
            sel = st.topk[plan.index_source]
            assert sel.shape[0] == len(rows), "selection and attention rows differ"
            N = sel.shape[1]
            keys = torch.cat((swa_keys, s.comp[plan.kv_source][:N]))
            mask = torch.cat((swa_mask, sel), dim=1)
        o = sparse_attention(q, keys, mask, w(f"{p}.attn.attn_sink"), D ** -0.5)
        o = apply_rope(o, pos, self._inv_freq[L], inverse=True)
        G = c.o_groups
        wo_a = w(f"{p}.attn.wo_a").view(G, c.o_lora_rank, c.heads_per_group * D)
        z = torch.einsum("tgk,gok->tgo", o.reshape(-1, G, c.heads_per_group * D), wo_a)
        return z.flatten(1) @ w(f"{p}.attn.wo_b").t()

    # ------------------------------------------------------------ MoE (§2.7)
    def moe(self, p: str, plan: LayerPlan, x: torch.Tensor) -> torch.Tensor:
        c, w = self.cfg, self.w
        lim = float(c.swiglu_limit)
        idx, wts = route(x, w(f"{p}.ffn.gate.weight"), w(f"{p}.ffn.gate.bias"), plan.experts_per_tok,
                         float(c.routed_scaling_factor))
        y = torch.zeros_like(x)
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            out = swiglu_clamped(x[tok], w(f"{p}.ffn.experts.{e}.w1"), w(f"{p}.ffn.experts.{e}.w3"),
                                 w(f"{p}.ffn.experts.{e}.w2"), lim)
            y.index_add_(0, tok, out * wts[tok, slot, None])
        return y + swiglu_clamped(x, w(f"{p}.ffn.shared_experts.w1"), w(f"{p}.ffn.shared_experts.w3"),
                                  w(f"{p}.ffn.shared_experts.w2"), lim)

    # ------------------------------------------------------------ one layer
    def _boundary(self, p: str, kind: str, S: torch.Tensor):
        c, w = self.cfg, self.w
        return hc_coefficients(S, w(f"{p}.hc_{kind}_fn"), w(f"{p}.hc_{kind}_base"), w(f"{p}.hc_{kind}_scale"),
                               self.eps, float(c.hc_eps), c.hc_sinkhorn_iters)

    def layer(self, s: Session, p: str, plan: LayerPlan, S: torch.Tensor, pre_prev: torch.Tensor,
              st: _Step, rows: torch.Tensor, floor: int, kv_rows_all: bool = False):
        """Returns (S, pre) for ``rows``.  With ``kv_rows_all`` the layer writes KV for every row of S
        (the boundary layer's KV pass) but attends and runs the MoE only for ``rows``."""
        w = self.w
        pre_a, post_a, comb_a = self._boundary(p, "attn", S)
        x = rms_norm(hc_collapse(S, pre_prev), w(f"{p}.attn_norm.weight"), self.eps)
        y = self.attention(s, p, plan, x, rows, st, floor, kv_rows_all)
        if kv_rows_all:
            S, pre_a, post_a, comb_a = S[rows], pre_a[rows], post_a[rows], comb_a[rows]
        S = hc_post(S, y, post_a, comb_a)
        pre_f, post_f, comb_f = self._boundary(p, "ffn", S)
        x = rms_norm(hc_collapse(S, pre_a), w(f"{p}.ffn_norm.weight"), self.eps)
        S = hc_post(S, self.moe(p, plan, x), post_f, comb_f)
        return S, pre_f

    # ------------------------------------------------------------ forward of one chunk
    def forward(self, s: Session, ids: list[int], *, swa_floor: int = 0, prune: bool = False,
                write_global_from: int = 0, all_logits: bool = False) -> torch.Tensor:
        """Run ``ids`` as the next chunk of request ``s``; returns logits of the last row ([V]) or of every row.

        ``swa_floor``: no SWA key below this position is read (bounded replay).  ``prune``: decoder layers
        run only on the chunk's last ``sliding_window`` rows (CED pruning, §3.2).  ``write_global_from``:
        compressed/index entries closed by tokens below this position keep their cached values (§3.3).
        """
        c, w = self.cfg, self.w
        start = s.length
        s.tokens.extend(ids)
        T = len(ids)
        pos = torch.arange(start, start + T)
        st = _Step(pos=pos, swa_floor=swa_floor, write_global_from=write_global_from)
        W = c.sliding_window
        keep_n = min(T, W) if (prune and c.decoder_prunable) else T
        if all_logits:
            keep_n = T
        kept = torch.arange(T - keep_n, T)
        all_rows = torch.arange(T)
        e = w("embed.weight")[torch.as_tensor(ids)]
        S = e[:, None, :].expand(T, c.hc_mult, c.hidden_size).clone()
        pre = torch.zeros(T, c.hc_mult)
        pre[:, 0] = 1.0
        targets = list(c.dspark_target_layer_ids) if c.n_draft_layers else []
        aux = torch.zeros(T, len(targets), c.hidden_size)
        rows_now = all_rows  # rows S currently holds (indices into the chunk)
        for L in range(c.n_layers):
            plan, p = c.plan(L), f"layers.{L}"
            if L in targets:
                aux[rows_now, targets.index(L)] = S.mean(1)
            if plan.has_engram:
                S = self.engram(p, S, self.engram_rows(s.tokens, pos[rows_now], L))
            if keep_n < T and L == c.boundary_layer:
                S, pre = self.layer(s, p, plan, S, pre, st, kept, swa_floor, kv_rows_all=True)
                rows_now = kept
            else:
                floor = max(swa_floor, start + T - W) if (plan.is_decoder and keep_n < T) else swa_floor
                S, pre = self.layer(s, p, plan, S, pre, st, rows_now, floor)
        if targets:
            s.aux = _grow(s.aux.flatten(1) if s.aux is not None else None, start + T,
                          len(targets) * c.hidden_size).view(-1, len(targets), c.hidden_size)
            s.aux[start:start + T] = aux
            self._draft_context(s, start, start + T)
        h = rms_norm(hc_collapse(S, pre), w("norm.weight"), self.eps)
        logits = h @ w("head.weight").t()
        return logits if all_logits else logits[-1]

    # ------------------------------------------------------------ DSpark draft (§5)
    def _draft_context(self, s: Session, lo: int, hi: int) -> None:
        """main_x of positions [lo, hi) -> each draft layer's SWA context KV."""
        c, w = self.cfg, self.w
        feats = s.aux[lo:hi].flatten(1)
        main_x = rms_norm(feats @ w("mtp.0.main_proj").t(), w("mtp.0.main_norm.weight"), self.eps)
        pos = torch.arange(lo, hi)
        for k in range(c.n_draft_layers):
            L, p = c.n_layers + k, f"mtp.{k}"
            kv = rms_norm(main_x @ w(f"{p}.attn.wkv").t(), w(f"{p}.attn.kv_norm.weight"), self.eps)
            kv = apply_rope(kv, pos, self._inv_freq[L])
            buf = _grow(s.draft_swa.get(L), hi, c.head_dim)
            buf[lo:hi] = self._q(kv, "mxfp8")
            s.draft_swa[L] = buf

    def draft(self, s: Session, anchor: int) -> list[int]:
        """One DSpark round: ``dspark_block_size`` greedy draft tokens following ``anchor`` (the token the
        target sampled at position ``s.length``)."""
        c, w = self.cfg, self.w
        N, n, Wn, D = c.dspark_block_size, s.length, c.sliding_window, c.head_dim
        ids = [anchor] + [c.dspark_noise_token_id] * (N - 1)
        pos = torch.arange(n, n + N)
        e = w("embed.weight")[torch.as_tensor(ids)]
        S = e[:, None, :].expand(N, c.hc_mult, c.hidden_size).clone()
        pre = torch.zeros(N, c.hc_mult)
        pre[:, 0] = 1.0
        lo = max(n - Wn, 0)
        for k in range(c.n_draft_layers):
            L, p = c.n_layers + k, f"mtp.{k}"
            plan = c.plan(L)
            pre_a, post_a, comb_a = self._boundary(p, "attn", S)
            x = rms_norm(hc_collapse(S, pre), w(f"{p}.attn_norm.weight"), self.eps)
            qr = rms_norm(x @ w(f"{p}.attn.wq_a").t(), w(f"{p}.attn.q_norm.weight"), self.eps)
            kv = rms_norm(x @ w(f"{p}.attn.wkv").t(), w(f"{p}.attn.kv_norm.weight"), self.eps)
            kv = self._q(apply_rope(kv, pos, self._inv_freq[L]), "mxfp8")
            q = apply_rope((qr @ w(f"{p}.attn.wq_b").t()).view(N, -1, D), pos, self._inv_freq[L])
            keys = torch.cat((s.draft_swa[L][lo:n], kv))  # context window + the whole block (non-causal)
            mask = torch.ones(N, keys.shape[0], dtype=torch.bool)
            o = sparse_attention(q, keys, mask, w(f"{p}.attn.attn_sink"), D ** -0.5)
            o = apply_rope(o, pos, self._inv_freq[L], inverse=True)
            G = c.o_groups
            wo_a = w(f"{p}.attn.wo_a").view(G, c.o_lora_rank, c.heads_per_group * D)
            y = torch.einsum("tgk,gok->tgo", o.reshape(N, G, -1), wo_a).flatten(1) @ w(f"{p}.attn.wo_b").t()
            S = hc_post(S, y, post_a, comb_a)
            pre_f, post_f, comb_f = self._boundary(p, "ffn", S)
            x = rms_norm(hc_collapse(S, pre_a), w(f"{p}.ffn_norm.weight"), self.eps)
            S = hc_post(S, self.moe(p, plan, x), post_f, comb_f)
            pre = pre_f
        last = f"mtp.{c.n_draft_layers - 1}"
        h = rms_norm(hc_collapse(S, pre), w(f"{last}.norm.weight"), self.eps)
        base = h @ w("head.weight").t()  # [N, V]
        m_in, m_out = w(f"{last}.markov_head.embed.weight"), w(f"{last}.markov_head.head.weight")
        out, prev = [], anchor
        for k in range(N):
            d = int(torch.argmax(base[k] + m_out @ m_in[prev]))
            out.append(d)
            prev = d
        return out

    # ------------------------------------------------------------ generation
    def generate(self, prompt: list[int], max_tokens: int, *, prune: bool = False, chunk: int | None = None,
                 replay_start: int | None = None, hit: int | None = None, filler: list[int] | None = None,
                 stop_at_eos: bool = False) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding.  Returns (tokens, per-step logits).

        ``chunk``: prefill in chunks of this size.  ``replay_start``/``hit``: the request was served from a
        prefix-cache hit of ``hit`` tokens; the prompt below ``hit`` is first computed exactly (as the
        request that filled the cache did), then positions [replay_start, len) are recomputed with the SWA
        floor at ``replay_start`` while the cached global entries below ``hit`` are kept.  ``filler``: the
        prompt of the request that filled the cache, prefilled the way it was (default ``prompt[:hit]``).
        With quantised records the cached entries depend, through fp32 rounding that a record code can
        flip on, on the extent of the chunk that wrote them; the engine's numbers are reproduced only
        when the reference fills the cache the same way.
        """
        s = Session()
        out, logits_seq = [], []
        if replay_start is not None:
            h = hit if hit is not None else replay_start
            self._prefill(s, filler if filler is not None else prompt[:h], chunk, prune)
            # forget the prefix's SWA state above replay_start: recompute it, floored
            s.tokens = s.tokens[:replay_start]
            logits = self._prefill(s, prompt[replay_start:], chunk, prune, swa_floor=replay_start,
                                   write_global_from=h)
        else:
            logits = self._prefill(s, prompt, chunk, prune)
        for _ in range(max_tokens):
            logits_seq.append(logits)
            t = int(torch.argmax(logits))
            out.append(t)
            if stop_at_eos and t == self.cfg.eos_token_id:
                break
            if len(out) == max_tokens:
                break
            logits = self.forward(s, [t], swa_floor=replay_start or 0)
        return out, logits_seq

    def _prefill(self, s: Session, ids: list[int], chunk: int | None, prune: bool, swa_floor: int = 0,
                 write_global_from: int = 0) -> torch.Tensor:
        step = chunk or max(len(ids), 1)
        logits = None
        for i in range(0, len(ids), step):
            logits = self.forward(s, ids[i:i + step], swa_floor=swa_floor, prune=prune,
                                  write_global_from=write_global_from)
        return logits
