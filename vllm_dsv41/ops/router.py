"""``dsv41::router`` - the MoE router ("Mega-Gate"): gate GEMM fused with sqrt-softplus top-k.

Maths (architecture.md §2.7; oracle ``reference.model.route``)::

    logits = x @ gate_weight.T            fp32 accumulation            [T, E]
    s      = sqrt(softplus(logits))                                      [T, E]
    ids    = top-k of (s + bias)          ties -> lower expert id        [T, k]
    w      = s[ids] / sum(s[ids]) * routed_scaling   (scaling applied exactly once)

Shapes: x [T, H] bf16 or fp32, gate_weight [E, H] bf16 (fp32 on the CPU path), bias [E] fp32 ->
(topk_ids [T, k] int32, topk_weights [T, k] fp32).  The k ids of a row come out in descending
order of their *biased* score s + bias (equal scores: lower expert id first), which is the order
``torch.topk`` gives the reference.  Served sizes: E = 384 (k = 6) in the target, E = 128 (k = 3) in
the DSpark draft, H = 5120, T = 1 .. 8192.

Why an op: unfused, the router is a GEMM plus seven small element-wise / top-k launches whose
launch latency dominates decode.  At small T the job is a bandwidth problem (reading the 384 x 5120
bf16 weight, 3.9 MB, once); at large T it is a skinny GEMM (N = E) whose epilogue is a per-row
top-k.

Triton design (``_router_gemm_kernel``):

* grid = (E tiles, T tiles, K splits), E fastest so the CTAs that share an x tile run together.
  Each CTA accumulates an fp32 [BLOCK_T, BLOCK_E] tile of partial logits over its slice of H with
  ``tl.dot`` (bf16 tensor cores; an fp32 weight uses IEEE fp32 so nothing is rounded to tf32)
  and writes it to a workspace ``part`` [SPLIT_K, T, E].
* Operands: bf16 x and weight go straight to ``tl.dot``; an fp32 x (the mHC streams' dtype) is split
  in-kernel into three bf16 parts whose sum is x exactly, so the logits keep fp32 products at tensor-core
  speed; an fp32 weight (the CPU-sized fp32 models) takes the IEEE FMA dot on small tiles.
* Tiles: T <= 64 uses 16 x 32 tiles (a GEMV in disguise: 12 E tiles for E = 384); larger T uses
  64 x 128 tiles on 8 warps.  H is then split (SPLIT_K <= 16, >= 256 columns each) until the grid
  covers the SMs, so at T = 1 about 120 CTAs each stream a 32 KB slice of the 3.9 MB weight at
  once; at T = 8192 there are already 384 tiles and no split.
* Fused epilogue (``FUSE_EPILOGUE``): after storing its tile a CTA bumps an arrival counter of its
  T tile (one ``atomic_add``, acq_rel, after a CTA barrier: the cooperative-groups grid-sync
  pattern); the CTA that arrives last sums the partials in a fixed split order (deterministic from run
  to run; the split count depends on T, so logits may differ in the last bit between batch
  sizes), applies sqrt-softplus + bias, picks the top-k by k rounds of
  (row max, lowest id attaining it) and writes ids and normalised weights, then re-arms the counter
  to zero.  The counters live in one zero-initialised buffer per device that every launch leaves
  at zero, so the op is CUDA-graph safe; two routers must not run concurrently on different
  streams of one device (they would share counters).
* ``fuse_epilogue=False``: the same epilogue as a second kernel over row groups (4 rows per program).  The
  default (:func:`fuse_pays`) fuses it only while a T tile's epilogue is small: the last CTA of a tile runs
  it alone, so a 16-row tile of 384 experts serialises 16 x 384 scores on one CTA.  CUPTI kernel times on
  an H200 (docs/benchmarks.md, session 9; fp32 x): E = 384, T = 64: fused 48.4 µs, two kernels 27.3 µs;
  E = 384, T = 1: 12.0 / 12.4 µs; E = 32 (bench), T = 1 and 64: 7.2 / 7.4 and 7.6 / 7.8 µs.

Numerics: the GPU logits equal the reference's up to fp32 summation order and sqrt-softplus to an
ulp or two (exp is the hardware approximation), so ids can differ from the reference only on
near-ties of s + bias; exact ties always resolve to the lower expert id.  The tests use inputs whose
dot products are exact in fp32, inputs with duplicated experts, and random inputs.
"""


import torch
import torch.nn.functional as F

from vllm_dsv41.ops import define_op, env_flag

from vllm_dsv41.ops._triton import (
    HAS_TRITON as _HAS_TRITON, ROW_COUNT_ARGS, gdc_launch_dependents, gdc_wait, interpreting, pdl, pdl_launch, sm_count,
    tl, triton,
)
from vllm_dsv41.reference.model import top_indices as _top_indices


# --------------------------------------------------------------------------- reference



def router_ref(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, topk: int,
               routed_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch router: the CPU implementation and the test oracle (fp32 throughout)."""
    s = torch.sqrt(F.softplus(x.float() @ gate_weight.float().t()))
    ids = _top_indices(s + bias.float(), topk)
    w = s.gather(-1, ids)
    return ids.to(torch.int32), w / w.sum(-1, keepdim=True) * routed_scaling


# --------------------------------------------------------------------------- Triton kernels


@triton.jit
def _top1(v1, i1, s1, v2, i2, s2):
    """Combine of the one-pass top-1: the larger biased score, on equal scores the lower expert id, with its s."""
    take1 = (v1 > v2) | ((v1 == v2) & (i1 < i2))
    return tl.where(take1, v1, v2), tl.where(take1, i1, i2), tl.where(take1, s1, s2)


@triton.jit
def _router_epilogue(
    part_ptr,     # [SPLIT_K, T, E] fp32 partial logits
    bias_ptr,     # [E] fp32
    ids_ptr,      # [T, TOPK] int32 out
    wts_ptr,      # [T, TOPK] fp32 out
    row_begin, row_end, T, E, routed_scaling,
    stride_it, stride_wt,
    SPLIT_K: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr,
    EPI_T: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """Rows [row_begin, row_end): sum partials, s = sqrt(softplus), top-k of s + bias, normalise.

    ``ONE_PASS``: each of the k rounds is one reduction of (biased score, id, s) triples (:func:`_top1`) instead of
    three in a row (the row max, the lowest id attaining it, its s); the same picks.  Each reduction across the CTA's
    warps is a shared-memory round trip with barriers, and the rounds are a serial chain."""
    cols = tl.arange(0, E_POW2)
    kcol = tl.arange(0, K_POW2)
    col_ok = cols < E
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
    for r0 in range(row_begin, row_end, EPI_T):
        rows = r0 + tl.arange(0, EPI_T)
        row_ok = rows < row_end
        m = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * E + cols[None, :]
        logits = tl.zeros([EPI_T, E_POW2], tl.float32)
        for sp in tl.static_range(SPLIT_K):  # fixed order: deterministic; unrolled: loads overlap
            # .cg: bypass L1, the partials were written by other CTAs
            logits += tl.load(part_ptr + sp * T * E + offs, mask=m, other=0.0, cache_modifier=".cg")
        # softplus(l) = max(l, 0) + log1p(exp(-|l|)); log1p(u) = u * log(1 + u) / ((1 + u) - 1)
        # (exact-rounding trick for small u) keeps sqrt(softplus) accurate for very negative logits.
        u = tl.exp(-tl.abs(logits))
        one_u = 1.0 + u
        log1p_u = tl.where(one_u == 1.0, u, tl.log(one_u) * (u / (one_u - 1.0)))
        s = tl.sqrt_rn(tl.maximum(logits, 0.0) + log1p_u)
        biased = tl.where(m, s + bias[None, :], float("-inf"))
        sel_ids = tl.zeros([EPI_T, K_POW2], tl.int32)
        sel_s = tl.zeros([EPI_T, K_POW2], tl.float32)
        ids2 = tl.broadcast_to(cols[None, :], [EPI_T, E_POW2])
        for j in tl.static_range(TOPK):
            if ONE_PASS:
                _, pick, s_pick = tl.reduce((biased, ids2, s), 1, _top1)
            else:
                best = tl.max(biased, axis=1)
                # lowest expert id attaining the row max: the shared tie rule
                pick = tl.min(tl.where(biased == best[:, None], cols[None, :], E_POW2), axis=1)
            hit = cols[None, :] == pick[:, None]
            if not ONE_PASS:
                s_pick = tl.sum(tl.where(hit, s, 0.0), axis=1)
            sel_ids = tl.where(kcol[None, :] == j, pick[:, None], sel_ids)
            sel_s = tl.where(kcol[None, :] == j, s_pick[:, None], sel_s)
            biased = tl.where(hit, float("-inf"), biased)
        total = tl.sum(sel_s, axis=1)
        wts = sel_s / total[:, None] * routed_scaling
        om = row_ok[:, None] & (kcol[None, :] < TOPK)
        tl.store(ids_ptr + rows[:, None] * stride_it + kcol[None, :], sel_ids, mask=om)
        tl.store(wts_ptr + rows[:, None] * stride_wt + kcol[None, :], wts, mask=om)


@triton.jit(do_not_specialize=ROW_COUNT_ARGS)
def _router_gemm_kernel(
    x_ptr,        # [T, H] bf16 / fp32
    w_ptr,        # [E, H] bf16 / fp32
    bias_ptr,     # [E] fp32
    part_ptr,     # [SPLIT_K, T, E] fp32 workspace (partial logits)
    count_ptr,    # [>= n T tiles] int32 arrival counters, zero on entry and on exit (FUSE_EPILOGUE)
    ids_ptr,      # [T, TOPK] int32 out
    wts_ptr,      # [T, TOPK] fp32 out
    T, H, E, routed_scaling, k_per_split,
    stride_xt, stride_xh, stride_we, stride_wh, stride_it, stride_wt,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, SPLIT_X: tl.constexpr, FUSE_EPILOGUE: tl.constexpr,
    ARRIVALS: tl.constexpr,
    TOPK: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr, EPI_T: tl.constexpr, ONE_PASS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    pid_e = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    t_ok = offs_t < T
    e_ok = offs_e < E
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, H)

    x_ptrs = x_ptr + offs_t[:, None] * stride_xt + offs_k[None, :] * stride_xh   # [BLOCK_T, BLOCK_K]
    w_ptrs = w_ptr + offs_e[None, :] * stride_we + offs_k[:, None] * stride_wh   # [BLOCK_K, BLOCK_E]
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            xt = tl.load(x_ptrs + k0 * stride_xh, mask=t_ok[:, None], other=0.0)
            wt = tl.load(w_ptrs + k0 * stride_wh, mask=e_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + offs_k) < k_end
            xt = tl.load(x_ptrs + k0 * stride_xh, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs + k0 * stride_wh, mask=e_ok[None, :] & k_ok[:, None], other=0.0)
        if SPLIT_X:
            # fp32 x, bf16 weight: x = hi + mid + lo exactly (each part bf16: 8 of fp32's 24 mantissa
            # bits), and bf16 x bf16 products are exact in fp32, so three tensor-core dots give the fp32
            # logits up to summation order (the FMA dot of fp32 tiles took 6.2x as long at T = 8192, E = 384)
            x32 = xt.to(tl.float32)
            hi = x32.to(tl.bfloat16)
            rest = x32 - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            if UPCAST:  # the interpreter has no bf16 dot: the same parts, fp32 products
                w32 = wt.to(tl.float32)
                acc = tl.dot(hi.to(tl.float32), w32, acc, input_precision="ieee")
                acc = tl.dot(mid.to(tl.float32), w32, acc, input_precision="ieee")
                acc = tl.dot(lo.to(tl.float32), w32, acc, input_precision="ieee")
            else:
                acc = tl.dot(hi, wt, acc)
                acc = tl.dot(mid, wt, acc)
                acc = tl.dot(lo, wt, acc)
        elif UPCAST:  # fp32 weight: exact fp32 products, no tf32 rounding
            acc = tl.dot(xt.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
        else:       # bf16 x bf16 -> fp32 accumulate on tensor cores
            acc = tl.dot(xt, wt, acc)

    part_ptrs = part_ptr + pid_k * T * E + offs_t[:, None] * E + offs_e[None, :]
    tl.store(part_ptrs, acc, mask=t_ok[:, None] & e_ok[None, :])

    if FUSE_EPILOGUE:
        row_begin = pid_t * BLOCK_T
        row_end = tl.minimum(row_begin + BLOCK_T, T)
        tl.debug_barrier()  # every thread of this CTA has stored its share of the tile
        if ARRIVALS == 1:  # one CTA owns whole rows: no counter needed
            _router_epilogue(part_ptr, bias_ptr, ids_ptr, wts_ptr, row_begin, row_end, T, E,
                             routed_scaling, stride_it, stride_wt, SPLIT_K, TOPK, K_POW2, E_POW2,
                             EPI_T, ONE_PASS)
        else:
            # one thread, gpu scope, acq_rel: publishes this CTA's tile / acquires the others'
            seen = tl.atomic_add(count_ptr + pid_t, 1, sem="acq_rel")
            if seen == ARRIVALS - 1:
                _router_epilogue(part_ptr, bias_ptr, ids_ptr, wts_ptr, row_begin, row_end, T, E,
                                 routed_scaling, stride_it, stride_wt, SPLIT_K, TOPK, K_POW2, E_POW2,
                                 EPI_T, ONE_PASS)
                tl.atomic_xchg(count_ptr + pid_t, 0)  # re-arm for the next launch / graph replay


@triton.jit(do_not_specialize=ROW_COUNT_ARGS)
def _router_epilogue_kernel(
    part_ptr, bias_ptr, ids_ptr, wts_ptr,   # as in _router_epilogue
    T, E, routed_scaling, stride_it, stride_wt,
    ROWS: tl.constexpr, SPLIT_K: tl.constexpr, TOPK: tl.constexpr, K_POW2: tl.constexpr,
    E_POW2: tl.constexpr, EPI_T: tl.constexpr, ONE_PASS: tl.constexpr = False, PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    row_begin = tl.program_id(0) * ROWS
    row_end = tl.minimum(row_begin + ROWS, T)
    _router_epilogue(part_ptr, bias_ptr, ids_ptr, wts_ptr, row_begin, row_end, T, E, routed_scaling,
                     stride_it, stride_wt, SPLIT_K, TOPK, K_POW2, E_POW2, EPI_T, ONE_PASS)


# --------------------------------------------------------------------------- launch wrapper

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """A per-device int32 buffer that is zero between launches (each launch re-arms what it used)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _router_config(T: int, E: int, H: int, sms: int, upcast: bool) -> dict:
    """Tile sizes, then enough H splits that the grid covers the GPU (the weight read at small T,
    the MMA units at medium T); each split keeps >= 256 columns so its partial stays worth it."""
    if upcast:  # fp32 FMA dot: small tiles keep the operands in registers
        block_t, block_e, block_k, warps, stages, target = 32, 64, 32, 4, 2, 2 * sms
    elif T <= 64:
        block_t, block_e, block_k, warps, stages, target = 16, 32, 128, 4, 4, sms
    else:
        block_t, block_e, block_k, warps, stages, target = 64, 128, 64, 8, 4, 2 * sms
    block_e = min(block_e, max(16, triton.next_power_of_2(E)))
    tiles = triton.cdiv(T, block_t) * triton.cdiv(E, block_e)
    split_k = max(1, min(16, triton.cdiv(target, tiles), triton.cdiv(H, 256)))
    return dict(BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, SPLIT_K=split_k,
                num_warps=warps, num_stages=stages)


#: Largest (rows of a T tile) x experts whose epilogue runs fused on the tile's last CTA (:func:`fuse_pays`).
FUSED_EPILOGUE_MAX_SCORES = 2048


def fuse_pays(T: int, E: int, block_t: int) -> bool:
    """Whether the top-k epilogue runs on the last CTA of each T tile (else as a second kernel): while a tile
    holds at most ``FUSED_EPILOGUE_MAX_SCORES`` scores.  The measured ends: 1 x 384 and 16 x 32 fused win,
    16 x 384 loses (48.4 against 27.3 µs at T = 64); the bound between them is a choice, not a measurement."""
    return min(T, block_t) * E <= FUSED_EPILOGUE_MAX_SCORES


ONE_PASS_ENV = "VLLM_DSV41_ROUTER_ONE_PASS"


def one_pass_setting() -> bool:
    """``VLLM_DSV41_ROUTER_ONE_PASS``: ``1`` runs each top-k round of the epilogue as one reduction of (score, id, s)
    triples, ``0`` (default) as three reductions (the same picks).  Measured on an H100 (docs/benchmarks.md, session
    32; one row, graph-replayed): 10.6 against 9.9 µs at E = 384, so the default stays three; 2-4% faster at E = 16
    and 32."""
    return env_flag(ONE_PASS_ENV, "0")


def _router_triton(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, topk: int,
                   routed_scaling: float, fuse_epilogue: bool | None = None,
                   config: dict | None = None, split_x: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the fused router.  ``config`` overrides the tile heuristics (benchmark sweeps);
    ``fuse_epilogue`` None lets :func:`fuse_pays` choose; ``split_x=False`` keeps an fp32 x on the FMA dot
    (the slow path, for comparison)."""
    assert x.dim() == 2 and gate_weight.dim() == 2 and x.shape[1] == gate_weight.shape[1]
    T, H = x.shape
    E = gate_weight.shape[0]
    assert bias.shape == (E,) and 0 < topk <= E
    bias = bias.float().contiguous()
    ids = torch.empty(T, topk, dtype=torch.int32, device=x.device)
    wts = torch.empty(T, topk, dtype=torch.float32, device=x.device)
    if T == 0:
        return ids, wts

    interpret = interpreting()
    # an fp32 x against the bf16 weight is split into three bf16 parts (tensor cores, fp32-exact products);
    # an fp32 weight (or other mixed dtypes) takes the IEEE fp32 FMA dot; the interpreter cannot multiply
    # bf16 tiles, so it runs every dot in fp32 (the split included)
    split_x = x.dtype == torch.float32 and gate_weight.dtype == torch.bfloat16 and split_x is not False
    fma = gate_weight.dtype == torch.float32 or (x.dtype != gate_weight.dtype and not split_x)
    upcast = interpret or fma
    cfg = _router_config(T, E, H, sm_count(x.device), fma)
    cfg.update(config or {})
    block_t, block_e, block_k = cfg.pop("BLOCK_T"), cfg.pop("BLOCK_E"), cfg.pop("BLOCK_K")
    if fuse_epilogue is None:
        fuse_epilogue = fuse_pays(T, E, block_t)
    split_k = cfg.pop("SPLIT_K")
    one_pass = cfg.pop("ONE_PASS", one_pass_setting())  # False: three reductions a top-k round (the earlier form)
    # every split gets a whole number of BLOCK_K steps; drop splits that would be empty
    k_per_split = triton.cdiv(triton.cdiv(H, split_k), block_k) * block_k
    split_k = triton.cdiv(H, k_per_split)
    even_k = H % block_k == 0
    part = torch.empty(split_k, T, E, dtype=torch.float32, device=x.device)
    n_t = triton.cdiv(T, block_t)
    counters = _arrival_counters(x.device, n_t)
    on = pdl(x)
    common = dict(TOPK=topk, K_POW2=triton.next_power_of_2(topk), E_POW2=triton.next_power_of_2(E),
                  EPI_T=max(1, min(16, 2048 // triton.next_power_of_2(E))), ONE_PASS=one_pass)
    _router_gemm_kernel[(triton.cdiv(E, block_e), n_t, split_k)](
        x, gate_weight, bias, part, counters, ids, wts,
        T, H, E, float(routed_scaling), k_per_split,
        x.stride(0), x.stride(1), gate_weight.stride(0), gate_weight.stride(1),
        ids.stride(0), wts.stride(0),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, SPLIT_K=split_k, EVEN_K=even_k,
        UPCAST=upcast, SPLIT_X=split_x, FUSE_EPILOGUE=fuse_epilogue, ARRIVALS=triton.cdiv(E, block_e) * split_k,
        **common, **cfg, **pdl_launch(on))
    if not fuse_epilogue:
        rows = 4
        _router_epilogue_kernel[(triton.cdiv(T, rows),)](
            part, bias, ids, wts, T, E, float(routed_scaling), ids.stride(0), wts.stride(0),
            ROWS=rows, SPLIT_K=split_k, **common, num_warps=4, **pdl_launch(on))
    return ids, wts


# --------------------------------------------------------------------------- registration


def _router_cuda(x, gate_weight, bias, topk, routed_scaling):
    return _router_triton(x, gate_weight, bias, topk, routed_scaling)


def _router_fake(x, gate_weight, bias, topk, routed_scaling):
    T = x.shape[0]
    return (x.new_empty(T, topk, dtype=torch.int32), x.new_empty(T, topk, dtype=torch.float32))


router = define_op(
    "router",
    "(Tensor x, Tensor gate_weight, Tensor bias, int topk, float routed_scaling) -> (Tensor, Tensor)",
    router_ref,
    _router_cuda if _HAS_TRITON else None,
    _router_fake,
)
