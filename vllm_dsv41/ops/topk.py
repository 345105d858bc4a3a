"""``dsv41::topk_select`` and ``dsv41::candidate_blocks`` - the indexer's row-wise selections.

Specification: architecture.md §2.5.5 and §7.2; oracles ``reference.model.topk_select`` and
``reference.model.candidate_mask``.  The reference returns boolean masks [T, N]; these ops return
index lists, and :func:`indices_to_mask` / :func:`blocks_to_mask` convert back so the two can be
compared exactly.

``topk_select(scores [T, N] fp32, n_vis [T] int32, topk) -> indices [T, topk] int32``
    Row t sees entries 0 .. n_vis[t]-1 (n_vis is clamped to [0, N]; scores past it are never
    returned).  When n_vis <= topk the row is 0, 1, .., n_vis-1 followed by -1 (the short-context
    shortcut: scores are not read).  Otherwise exactly topk visible entries: the largest scores,
    equal scores going to the lower index; -inf is an ordinary (lowest) value, so a row with fewer
    than topk finite scores is filled with its lowest-indexed -inf entries, as in the reference.
    Selected indices are listed in ascending index order.

``candidate_blocks(scores [T, N] fp32, n_vis [T] int32, block_size, n_blocks) -> ids [T, n_blocks]``
    Blocks of ``block_size`` consecutive entries; a block is visible when its first entry is.
    Score of a block = max over its entries; the block holding the newest visible entry is pinned
    to +inf.  When at most n_blocks blocks are visible all of them are kept, otherwise the best
    n_blocks (equal maxima: lower block id).  Kept block ids in ascending order, -1 padded.

Both share one tie rule with the reference (``top_indices``): equal values -> lower index, and
-0.0 == +0.0.  NaN scores are not supported.

Why ops: the reference sorts whole rows (O(N log N), N up to 1M); a selection pass is linear and
the index lists are what the sparse attention and the consumers' candidate filter read.

Triton design: one CTA per row (a persistent grid of at most 2 programs per SM walks the rows, so
the scratch is per program), an exact select on the float bit pattern:

* Keys: an fp32 score maps to an int32 whose signed order is the float order (negative floats get
  their 31 magnitude bits flipped; -0.0 is first folded into +0.0).
* Pass A (cheap, one max per entry): theta = min over G >= k residue classes (index mod G) of the
  class maximum.  Those G maxima are >= k distinct entries, so theta <= tau, the k-th largest key.
* Pass B: count the entries > theta and compact them (key, index; a prefix sum keeps index order)
  into a per-program candidate buffer.  For Gaussian-like rows that is ~6k entries for k = 512,
  whatever N is.  Then one of three endings:
  - fewer than k candidates: tau = theta, gather from the row (ties at theta are common with
    quantised or ReLU-heavy scores);
  - the candidates fit the buffer (``CAP``): radix select on them only - counting passes of
    ``CAND_BITS`` (4) bits from the top, each a ``tl.histogram`` of the next digit over the keys that
    still match the prefix chosen so far, taking the digit where the running count from the top
    reaches the number still needed; after 32 / CAND_BITS passes the prefix is tau exactly and
    ``k_eq`` says how many tau-entries to take - then gather from the candidates;
  - otherwise (adversarial rows): the same radix select over the whole row (``ROW_BITS`` = 8).
* Gather: scan in index order, keep key > tau, and key == tau while its running rank among the
  tau-entries is below k_eq (the lower-index tie rule); output slots come from a prefix sum, so the
  list is in index order and the kernel is deterministic (no atomics).
* So a row is read from memory twice (passes A and B; three times when tau = theta), and the
  costly histograms (about three warp instructions per key for 256 bins) only touch candidates.
  Row loops are software-pipelined (``tl.range(num_stages=STAGES)``, cp.async into shared memory).
* Register route (the default for rows up to ``REG_MAX_N`` = 4,096 wide, ``IN_REGS``): the row is one tile, loaded
  once; the radix passes (``REG_BITS`` = 4) histogram that tile in registers and the gather scans it, so a row costs
  one read and 8 histograms of at most 4,096 keys, with no scratch and no barriers on global memory.  A batch-64
  decode step's rows are 550-1,280 entries in 1,024-2,048 columns (bench workload), which the compaction path above
  took 28-33 µs for (session 21 profile; pass A, pass B, the candidate radix and the gather each a loop over memory).
* The register route's sort form (``REG_SORT``, a config option, session 32; not yet timed): one bitonic sort
  (``tl.sort``) of the row's (key, BLOCK - 1 - index) pairs packed in int64, whose k-th largest is the threshold,
  then one prefix sum writes the k indices at or above it in index order.  A batch-1 decode step's selections are
  8 launches of ~30 µs (docs/benchmarks.md, sessions 31-32): eight counting passes of 4-bit digits, each a histogram
  with barriers, on one CTA; the sort trades them for log2(BLOCK) * (log2(BLOCK) + 1) / 2 compare-exchange stages.
  ``benchmarks/ops/bench_topk.py --decode`` times the routes.
* ``candidate_blocks`` first writes the per-block maxima as keys (the pinned block gets the key of
  +inf) to a per-program scratch row, then runs the same select over the nvb = ceil(n_vis /
  block_size) block keys with G = n_blocks classes.
* Rows at or below the limit (n_vis <= topk, or nvb <= n_blocks) only write 0..n-1, -1.
* Limits: one CTA per row leaves SMs idle when T is far below the SM count (decode with a single
  sequence and N ~ 1M reads 4 MB through one SM); splitting such rows over several CTAs (class
  maxima by atomic max, per-slice compaction, a finishing CTA) is the next step if it matters.
"""

import torch
import torch.nn.functional as F

from vllm_dsv41.ops import define_op, env_rows

from vllm_dsv41.ops._triton import (
    HAS_TRITON as _HAS_TRITON, ROW_COUNT_ARGS, gdc_launch_dependents, gdc_wait, pdl, pdl_launch, tl, triton,
)
from vllm_dsv41.reference.model import top_indices as _top_indices


# --------------------------------------------------------------------------- reference



def _prefix_rows(n: torch.Tensor, width: int) -> torch.Tensor:
    """[T, width] int32: 0, 1, .., n[t]-1 then -1."""
    ar = torch.arange(width, device=n.device)
    return torch.where(ar[None, :] < n[:, None], ar[None, :], -1).to(torch.int32)


def topk_select_ref(scores: torch.Tensor, n_vis: torch.Tensor, topk: int) -> torch.Tensor:
    """Plain-PyTorch ``topk_select``: the CPU implementation and the test oracle."""
    T, N = scores.shape
    n = n_vis.to(device=scores.device, dtype=torch.long).clamp(0, N)
    out = _prefix_rows(n, topk)
    long_rows = n > topk
    if long_rows.any():
        s = scores[long_rows].float() + 0.0  # -0.0 -> +0.0: GPU radix sorts would order the two zeros
        s = s.masked_fill(torch.arange(N, device=s.device)[None, :] >= n[long_rows, None], float("-inf"))
        out[long_rows] = _top_indices(s, topk).sort(-1).values.to(torch.int32)
    return out


def candidate_blocks_ref(scores: torch.Tensor, n_vis: torch.Tensor, block_size: int,
                         n_blocks: int) -> torch.Tensor:
    """Plain-PyTorch ``candidate_blocks``: the CPU implementation and the test oracle."""
    T, N = scores.shape
    nb = -(-N // block_size)
    n = n_vis.to(device=scores.device, dtype=torch.long).clamp(0, N)
    nvb = -(-n // block_size)
    out = _prefix_rows(nvb, n_blocks)
    long_rows = nvb > n_blocks
    if long_rows.any():
        s = F.pad(scores[long_rows].float(), (0, nb * block_size - N), value=float("-inf"))
        bmax = s.view(-1, nb, block_size).amax(-1) + 0.0  # -0.0 -> +0.0, as above
        rows = torch.arange(bmax.shape[0], device=s.device)
        bmax[rows, nvb[long_rows] - 1] = float("inf")  # the newest visible entry's block
        bmax = bmax.masked_fill(torch.arange(nb, device=s.device)[None, :] >= nvb[long_rows, None],
                                float("-inf"))
        out[long_rows] = _top_indices(bmax, n_blocks).sort(-1).values.to(torch.int32)
    return out


def indices_to_mask(indices: torch.Tensor, n_cols: int) -> torch.Tensor:
    """[T, K] index lists (-1 = none) -> bool [T, n_cols], the reference's mask form."""
    T = indices.shape[0]
    idx = torch.where(indices < 0, n_cols, indices).long()
    mask = torch.zeros(T, n_cols + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(1, idx, True)
    return mask[:, :n_cols]


def blocks_to_mask(block_ids: torch.Tensor, block_size: int, n_cols: int) -> torch.Tensor:
    """[T, n_blocks] block ids (-1 = none) -> bool [T, n_cols] (``candidate_mask`` form)."""
    nb = -(-n_cols // block_size)
    mask = indices_to_mask(block_ids, nb)  # [T, nb] -> each block's flag over its block_size columns
    return mask[:, :, None].expand(-1, nb, block_size).reshape(mask.shape[0], nb * block_size)[:, :n_cols]


# --------------------------------------------------------------------------- Triton kernels

_KEY_MIN = tl.constexpr(-2147483648)  # below every float key (the key of -inf is -2139095041)
_KEY_MAX = tl.constexpr(2147483647)


@triton.jit
def _float_key(v):
    """fp32 -> int32 whose signed order is the float order; -0.0 and +0.0 get the same key."""
    v = tl.where(v == 0.0, 0.0, v)
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _load_keys(src_ptr, offs, ok, IS_KEY: tl.constexpr):
    """Keys at ``offs``: stored keys (IS_KEY) or fp32 scores converted on the fly."""
    if IS_KEY:
        key = tl.load(src_ptr + offs, mask=ok, other=0)
    else:
        key = _float_key(tl.load(src_ptr + offs, mask=ok, other=float("-inf")))
    return key


@triton.jit
def _tile_hist(key, ok, prefix, SHIFT: tl.constexpr, WIDTH: tl.constexpr, NBINS: tl.constexpr,
               FIRST: tl.constexpr):
    """Histogram [NBINS] of the WIDTH-bit digit at SHIFT of the keys of one tile (lanes ``ok``) whose higher bits
    equal ``prefix``."""
    if FIRST:
        match = ok
        digit = (key >> SHIFT) + (1 << (WIDTH - 1))  # signed top digit -> 0 .. 2^WIDTH - 1
    else:
        match = ok & ((key & (-(1 << (SHIFT + WIDTH)))) == prefix)
        digit = (key >> SHIFT) & ((1 << WIDTH) - 1)
    # non-matching lanes are counted in bin 0, then taken out again
    hist = tl.histogram(tl.where(match, digit, 0), NBINS)
    return hist - tl.where(tl.arange(0, NBINS) == 0, tl.sum(tl.where(match, 0, 1)), 0)


@triton.jit
def _pick_digit(hist, prefix, k_rem, SHIFT: tl.constexpr, WIDTH: tl.constexpr, NBINS: tl.constexpr,
                FIRST: tl.constexpr):
    """The prefix extended by the digit that holds the k_rem-th largest key of ``hist``, and how many are still
    needed inside that digit."""
    bins = tl.arange(0, NBINS)
    at_least = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # keys whose digit is >= bin
    digit = tl.sum((at_least >= k_rem).to(tl.int32)) - 1
    above = tl.sum(tl.where(bins > digit, hist, 0))
    if FIRST:
        prefix = (digit - (1 << (WIDTH - 1))) << SHIFT
    else:
        prefix = prefix | (digit << SHIFT)
    return prefix, k_rem - above


@triton.jit
def _radix_pass(src_ptr, n, prefix, k_rem, SHIFT: tl.constexpr, WIDTH: tl.constexpr,
                NBINS: tl.constexpr, FIRST: tl.constexpr, IS_KEY: tl.constexpr, BLOCK: tl.constexpr,
                STAGES: tl.constexpr):
    """Histogram the WIDTH-bit digit at SHIFT of the keys whose higher bits equal ``prefix``;
    return the prefix extended by the digit that holds the k_rem-th largest of them, and how many
    are still needed inside that digit."""
    hist = tl.zeros([NBINS], tl.int32)
    for start in tl.range(0, n, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < n
        hist += _tile_hist(_load_keys(src_ptr, offs, ok, IS_KEY), ok, prefix, SHIFT, WIDTH, NBINS, FIRST)
    return _pick_digit(hist, prefix, k_rem, SHIFT, WIDTH, NBINS, FIRST)


@triton.jit
def _radix_threshold(src_ptr, n, k, IS_KEY: tl.constexpr, BLOCK: tl.constexpr,
                     BITS: tl.constexpr, NBINS: tl.constexpr, STAGES: tl.constexpr):
    """(tau, k_eq): the exact key of the k-th largest of src[0:n] and how many keys equal to tau
    belong to the top k.  32 / BITS counting passes, most significant digit first."""
    tau = 0
    k_eq = k
    for p in tl.static_range(32 // BITS):
        tau, k_eq = _radix_pass(src_ptr, n, tau, k_eq, 32 - (p + 1) * BITS, BITS, NBINS, p == 0,
                                IS_KEY, BLOCK, STAGES)
    return tau, k_eq


@triton.jit
def _gather_tile(key, ok, idx, tau, k_eq, dst_ptr, n_out, n_eq):
    """One tile of :func:`_gather`: write ``idx`` of every key > tau and of the tau-keys whose rank among all
    tau-keys so far (``n_eq`` before this tile) is below k_eq, at output slots from ``n_out`` on; returns the
    updated (n_out, n_eq)."""
    eq = (ok & (key == tau)).to(tl.int32)
    eq_rank = n_eq + tl.cumsum(eq, 0) - eq
    take = ((ok & (key > tau)) | ((eq != 0) & (eq_rank < k_eq))).to(tl.int32)
    pos = n_out + tl.cumsum(take, 0) - take
    tl.store(dst_ptr + pos, idx, mask=take != 0)
    return n_out + tl.sum(take), n_eq + tl.sum(eq)


@triton.jit
def _gather(key_ptr, idx_ptr, n, tau, k_eq, dst_ptr, IS_KEY: tl.constexpr, HAS_IDX: tl.constexpr,
            BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Scan src[0:n] in order; write the index of every key > tau and of the first k_eq keys == tau
    (the lower-index tie rule) to dst, packed and in index order.  Indices are the positions, or
    idx[position] with HAS_IDX (a compacted candidate list)."""
    n_out = 0
    n_eq = 0
    for start in tl.range(0, n, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < n
        key = _load_keys(key_ptr, offs, ok, IS_KEY)
        if HAS_IDX:
            idx = tl.load(idx_ptr + offs, mask=ok, other=0)
        else:
            idx = offs
        n_out, n_eq = _gather_tile(key, ok, idx, tau, k_eq, dst_ptr, n_out, n_eq)


@triton.jit
def _select_row_in_registers(src_ptr, n, k, dst_ptr, BLOCK: tl.constexpr, BITS: tl.constexpr,
                             NBINS: tl.constexpr, SORT: tl.constexpr = False):
    """:func:`_select_row` for a row that fits one tile (n <= BLOCK): the keys are loaded once and stay in
    registers through the 32 / BITS counting passes and the gather (no scratch, no second read).

    ``SORT``: instead of the counting passes, one bitonic sort of (key, BLOCK - 1 - index) pairs packed in int64
    (unique, ordered as the tie rule orders the entries: larger key first, then lower index), whose k-th largest is
    the threshold; the k pairs at or above it are the selection, written in index order by one prefix sum."""
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    key = _float_key(tl.load(src_ptr + offs, mask=ok, other=float("-inf")))
    if SORT:
        packed = (tl.where(ok, key, _KEY_MIN).to(tl.int64) << 32) | (BLOCK - 1 - offs).to(tl.int64)
        ranked = tl.sort(packed, descending=True)
        threshold = tl.sum(tl.where(offs == k - 1, ranked, 0))
        take = (ok & (packed >= threshold)).to(tl.int32)
        tl.store(dst_ptr + tl.cumsum(take, 0) - take, offs, mask=take != 0)
    else:
        tau = 0
        k_eq = k
        for p in tl.static_range(32 // BITS):
            hist = _tile_hist(key, ok, tau, 32 - (p + 1) * BITS, BITS, NBINS, p == 0)
            tau, k_eq = _pick_digit(hist, tau, k_eq, 32 - (p + 1) * BITS, BITS, NBINS, p == 0)
        _gather_tile(key, ok, offs, tau, k_eq, dst_ptr, 0, 0)


@triton.jit
def _select_row(src_ptr, n, k, dst_ptr, cand_key_ptr, cand_idx_ptr, cap,
                IS_KEY: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr,
                CAND_BLOCK: tl.constexpr, CAND_BITS: tl.constexpr, CAND_BINS: tl.constexpr,
                ROW_BITS: tl.constexpr, ROW_BINS: tl.constexpr, STAGES: tl.constexpr):
    """Indices of the k largest of src[0:n] (n > k) -> dst[0:k], in index order.

    1. theta = min over GROUPS >= k residue classes (index mod GROUPS) of the class maximum: those
       maxima are >= k distinct entries, so theta <= tau (the k-th largest).
    2. Count and compact the entries > theta (key and index, in index order) into the candidate
       buffer.  Fewer than k of them: tau = theta, gather from the row.  Otherwise, if they fit in
       ``cap``, run the radix select on the (typically ~6k) candidates only; else on the whole row.
    """
    R: tl.constexpr = BLOCK // GROUPS
    group = tl.arange(0, GROUPS)
    slot = tl.arange(0, R)[:, None] * GROUPS + group[None, :]                       # [R, GROUPS]
    gmax = tl.full([R, GROUPS], _KEY_MIN, tl.int32)
    for start in tl.range(0, n, BLOCK, num_stages=STAGES):
        ok = start + slot < n
        gmax = tl.maximum(gmax, tl.where(ok, _load_keys(src_ptr, start + slot, ok, IS_KEY), _KEY_MIN))
    # class g is non-empty exactly when g < n
    theta = tl.min(tl.where(group < n, tl.max(gmax, axis=0), _KEY_MAX))

    n_gt = 0
    for start in tl.range(0, n, BLOCK, num_stages=STAGES):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < n
        key = _load_keys(src_ptr, offs, ok, IS_KEY)
        gt = (ok & (key > theta)).to(tl.int32)
        pos = n_gt + tl.cumsum(gt, 0) - gt
        keep = (gt != 0) & (pos < cap)
        tl.store(cand_key_ptr + pos, key, mask=keep)
        tl.store(cand_idx_ptr + pos, offs, mask=keep)
        n_gt += tl.sum(gt)
    tl.debug_barrier()  # candidates written by some threads are read by others

    if n_gt < k:
        _gather(src_ptr, src_ptr, n, theta, k - n_gt, dst_ptr, IS_KEY, False, BLOCK, STAGES)
    elif n_gt <= cap:
        tau, k_eq = _radix_threshold(cand_key_ptr, n_gt, k, True, CAND_BLOCK, CAND_BITS, CAND_BINS,
                                     STAGES)
        _gather(cand_key_ptr, cand_idx_ptr, n_gt, tau, k_eq, dst_ptr, True, True, CAND_BLOCK, STAGES)
    else:
        tau, k_eq = _radix_threshold(src_ptr, n, k, IS_KEY, BLOCK, ROW_BITS, ROW_BINS, STAGES)
        _gather(src_ptr, src_ptr, n, tau, k_eq, dst_ptr, IS_KEY, False, BLOCK, STAGES)
    tl.debug_barrier()  # the scratch rows are reused by this program's next row


@triton.jit
def _write_prefix_row(dst_ptr, n, width, OUT_BLOCK: tl.constexpr):
    """dst[0:width] = 0, 1, .., n-1, -1, .., -1."""
    for j0 in range(0, width, OUT_BLOCK):
        j = j0 + tl.arange(0, OUT_BLOCK)
        tl.store(dst_ptr + j, tl.where(j < n, j, -1), mask=j < width)


@triton.jit(do_not_specialize=ROW_COUNT_ARGS)
def _topk_select_kernel(
    scores_ptr,   # [T, N] fp32, unit stride along N
    nvis_ptr,     # [T] int32
    out_ptr,      # [T, topk] int32
    cand_key_ptr,  # [programs, cap] int32 scratch
    cand_idx_ptr,  # [programs, cap] int32 scratch
    T, N, topk, cap, stride_s, stride_o, stride_c,
    BLOCK: tl.constexpr, GROUPS: tl.constexpr, OUT_BLOCK: tl.constexpr, CAND_BLOCK: tl.constexpr,
    CAND_BITS: tl.constexpr, CAND_BINS: tl.constexpr, ROW_BITS: tl.constexpr, ROW_BINS: tl.constexpr,
    STAGES: tl.constexpr, IN_REGS: tl.constexpr, REG_BITS: tl.constexpr, REG_BINS: tl.constexpr,
    REG_SORT: tl.constexpr = False, PDL: tl.constexpr = False,
):
    # IN_REGS: every row fits one tile (N <= BLOCK) and is selected in registers
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    cand_key = cand_key_ptr + pid.to(tl.int64) * stride_c
    cand_idx = cand_idx_ptr + pid.to(tl.int64) * stride_c
    nprog = tl.num_programs(0)
    for it in range(0, tl.cdiv(T - pid, nprog)):  # persistent: scratch is per program, not per row
        row = pid + it * nprog
        n = tl.minimum(tl.maximum(tl.load(nvis_ptr + row), 0), N)
        dst = out_ptr + row.to(tl.int64) * stride_o
        if n <= topk:
            _write_prefix_row(dst, n, topk, OUT_BLOCK)
        elif IN_REGS:
            _select_row_in_registers(scores_ptr + row.to(tl.int64) * stride_s, n, topk, dst, BLOCK, REG_BITS,
                                     REG_BINS, REG_SORT)
        else:
            _select_row(scores_ptr + row.to(tl.int64) * stride_s, n, topk, dst, cand_key, cand_idx,
                        cap, False, BLOCK, GROUPS, CAND_BLOCK, CAND_BITS, CAND_BINS, ROW_BITS,
                        ROW_BINS, STAGES)


@triton.jit(do_not_specialize=ROW_COUNT_ARGS)
def _candidate_blocks_kernel(
    scores_ptr,   # [T, N] fp32, unit stride along N
    nvis_ptr,     # [T] int32
    out_ptr,      # [T, n_blocks] int32
    bkey_ptr,     # [programs, ceil(N / BS)] int32 scratch: block-max keys
    cand_key_ptr,  # [programs, cap] int32 scratch
    cand_idx_ptr,  # [programs, cap] int32 scratch
    T, N, n_blocks, cap, stride_s, stride_o, stride_b, stride_c,
    BS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr, GROUPS: tl.constexpr,
    OUT_BLOCK: tl.constexpr, CAND_BLOCK: tl.constexpr, CAND_BITS: tl.constexpr,
    CAND_BINS: tl.constexpr, ROW_BITS: tl.constexpr, ROW_BINS: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel first
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    bkeys = bkey_ptr + pid.to(tl.int64) * stride_b
    cand_key = cand_key_ptr + pid.to(tl.int64) * stride_c
    cand_idx = cand_idx_ptr + pid.to(tl.int64) * stride_c
    nprog = tl.num_programs(0)
    for it in range(0, tl.cdiv(T - pid, nprog)):
        row = pid + it * nprog
        n = tl.minimum(tl.maximum(tl.load(nvis_ptr + row), 0), N)
        nvb = (n + BS - 1) // BS
        dst = out_ptr + row.to(tl.int64) * stride_o
        if nvb <= n_blocks:
            _write_prefix_row(dst, nvb, n_blocks, OUT_BLOCK)
        else:
            src = scores_ptr + row.to(tl.int64) * stride_s
            for b0 in tl.range(0, nvb, BLOCK_B, num_stages=STAGES):
                blk = b0 + tl.arange(0, BLOCK_B)
                offs = blk[:, None] * BS + tl.arange(0, BS)[None, :]                # [BLOCK_B, BS]
                bmax = tl.max(tl.load(src + offs, mask=offs < n, other=float("-inf")), axis=1)
                bmax = tl.where(blk == nvb - 1, float("inf"), bmax)  # pin the newest visible block
                tl.store(bkeys + blk, _float_key(bmax), mask=blk < nvb)
            tl.debug_barrier()  # the block keys are re-read by other threads of this CTA
            _select_row(bkeys, nvb, n_blocks, dst, cand_key, cand_idx, cap, True, BLOCK, GROUPS,
                        CAND_BLOCK, CAND_BITS, CAND_BINS, ROW_BITS, ROW_BINS, STAGES)


# --------------------------------------------------------------------------- launch wrappers


def _programs(device: torch.device, T: int, per_sm: int = 2) -> int:
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(T, per_sm * sms))


REG_MAX_N = 4096
"""Widest score rows ``topk_select`` selects in registers (one tile, ``IN_REGS``): the decode steps' widths at
contexts up to 4k (ratio 1) or 8k (ratio 2); wider rows take the candidate-compaction path."""
REG_WIDTH_ENV = "VLLM_DSV41_TOPK_REGISTER_WIDTH"


def register_width() -> int:
    """``VLLM_DSV41_TOPK_REGISTER_WIDTH``: the widest rows of the register route (default :data:`REG_MAX_N`, at most
    that; 0: never, the compaction path for every row, as before session 22)."""
    return min(env_rows(REG_WIDTH_ENV, REG_MAX_N), REG_MAX_N)


def _select_config(n: int, k: int) -> dict:
    """Launch parameters for selecting k of up to n keys per row (overridable by ``config``; ``IN_REGS`` None: the
    register route when n fits :func:`register_width`)."""
    groups = triton.next_power_of_2(max(k, 1))
    block = max(groups, min(2048, max(256, triton.next_power_of_2(n))))
    return dict(BLOCK=block, GROUPS=groups, CAND_BLOCK=1024, CAND_BITS=4, ROW_BITS=8, STAGES=3,
                CAP=min(n, max(16 * k, 16384)), PROGRAMS=None, num_warps=8 if block >= 2048 else 4,
                IN_REGS=None, REG_BITS=4, REG_SORT=False)


def _resolve_in_regs(cfg: dict, n: int) -> dict:
    """``cfg`` with ``IN_REGS`` decided for rows of width ``n``; the register route's tile covers the row."""
    cfg = dict(cfg)
    if cfg["IN_REGS"] is None:
        cfg["IN_REGS"] = triton.next_power_of_2(max(n, 1)) <= register_width()
    if cfg["IN_REGS"]:
        cfg["BLOCK"] = max(cfg["GROUPS"], triton.next_power_of_2(max(n, 16)))
        cfg["num_warps"] = 8 if cfg["BLOCK"] >= 2048 else 4
        cfg["CAP"] = 16  # the scratch is not used; 16 keeps its second half 16-byte aligned at any program count
        # (one compiled variant for every row count, tests/ops/test_specialization.py)
    return cfg


def _launch_args(cfg: dict) -> dict:
    """Split the user-facing config into kernel constexprs / launch options."""
    cfg = dict(cfg)
    for key in ("CAP", "PROGRAMS"):
        cfg.pop(key)
    assert cfg["BLOCK"] % cfg["GROUPS"] == 0 and 32 % cfg["CAND_BITS"] == 0 and 32 % cfg["ROW_BITS"] == 0
    # the Triton histogram wants at least one bin per lane of a warp
    cfg["CAND_BINS"] = max(32, 1 << cfg["CAND_BITS"])
    cfg["ROW_BINS"] = max(32, 1 << cfg["ROW_BITS"])
    if "REG_BITS" in cfg:  # topk_select's register route (candidate_blocks has none)
        assert 32 % cfg["REG_BITS"] == 0
        cfg["REG_BINS"] = max(32, 1 << cfg["REG_BITS"])
    return cfg


def _prep_scores(scores: torch.Tensor, n_vis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert scores.dim() == 2 and n_vis.shape == (scores.shape[0],)
    scores = scores.float()
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    return scores, n_vis.to(device=scores.device, dtype=torch.int32).contiguous()


def _topk_select_triton(scores: torch.Tensor, n_vis: torch.Tensor, topk: int,
                        config: dict | None = None) -> torch.Tensor:
    """Launch ``_topk_select_kernel``; ``config`` overrides the launch heuristics (tests, sweeps)."""
    scores, n_vis = _prep_scores(scores, n_vis)
    T, N = scores.shape
    out = torch.empty(T, topk, dtype=torch.int32, device=scores.device)
    if T == 0 or topk == 0:
        return out
    cfg = _select_config(N, topk)
    cfg.update(config or {})
    cfg = _resolve_in_regs(cfg, N)
    programs = cfg["PROGRAMS"] or _programs(scores.device, T)
    cap = max(1, cfg["CAP"])
    cand = torch.empty(2, programs, cap, dtype=torch.int32, device=scores.device)
    _topk_select_kernel[(programs,)](
        scores, n_vis, out, cand[0], cand[1], T, N, topk, cap,
        scores.stride(0), out.stride(0), cand.stride(1),
        OUT_BLOCK=min(1024, triton.next_power_of_2(topk)), **_launch_args(cfg), **pdl_launch(pdl(scores)))
    return out


def _candidate_blocks_triton(scores: torch.Tensor, n_vis: torch.Tensor, block_size: int,
                             n_blocks: int, config: dict | None = None) -> torch.Tensor:
    """Launch ``_candidate_blocks_kernel``; ``config`` overrides the launch heuristics."""
    assert block_size > 0 and block_size & (block_size - 1) == 0, "block_size must be a power of 2"
    scores, n_vis = _prep_scores(scores, n_vis)
    T, N = scores.shape
    nb = triton.cdiv(N, block_size)
    out = torch.empty(T, n_blocks, dtype=torch.int32, device=scores.device)
    if T == 0 or n_blocks == 0:
        return out
    cfg = _select_config(nb, n_blocks)
    del cfg["IN_REGS"], cfg["REG_BITS"], cfg["REG_SORT"]  # block keys are staged in scratch: no register route
    cfg.update(config or {})
    programs = cfg["PROGRAMS"] or _programs(scores.device, T)
    # scratch is only touched by rows with more than n_blocks visible blocks
    big = nb > n_blocks
    cap = max(1, cfg["CAP"]) if big else 1
    bkeys = torch.empty(programs, nb if big else 1, dtype=torch.int32, device=scores.device)
    cand = torch.empty(2, programs, cap, dtype=torch.int32, device=scores.device)
    _candidate_blocks_kernel[(programs,)](
        scores, n_vis, out, bkeys, cand[0], cand[1], T, N, n_blocks, cap,
        scores.stride(0), out.stride(0), bkeys.stride(0), cand.stride(1),
        BS=block_size, BLOCK_B=max(1, 2048 // block_size),
        OUT_BLOCK=min(1024, triton.next_power_of_2(n_blocks)), **_launch_args(cfg), **pdl_launch(pdl(scores)))
    return out


# --------------------------------------------------------------------------- registration


def _topk_select_fake(scores, n_vis, topk):
    return scores.new_empty(scores.shape[0], topk, dtype=torch.int32)


def _candidate_blocks_fake(scores, n_vis, block_size, n_blocks):
    return scores.new_empty(scores.shape[0], n_blocks, dtype=torch.int32)


topk_select = define_op(
    "topk_select",
    "(Tensor scores, Tensor n_vis, int topk) -> Tensor",
    topk_select_ref,
    _topk_select_triton if _HAS_TRITON else None,
    _topk_select_fake,
)

candidate_blocks = define_op(
    "candidate_blocks",
    "(Tensor scores, Tensor n_vis, int block_size, int n_blocks) -> Tensor",
    candidate_blocks_ref,
    _candidate_blocks_triton if _HAS_TRITON else None,
    _candidate_blocks_fake,
)
