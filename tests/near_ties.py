"""Near-tie decisions of the reference forward, and the logits when one of them goes the other way.

An implementation with other rounding (a GPU: other summation orders, fused kernels) computes every value of
the reference to a few fp32 ulp, but a discrete decision whose input sits that close to its boundary can land
on the other side: a cache-record quantiser's rounding (MXFP8 SWA, NVFP4 compressed KV, MXFP4 index K: an
element near the midpoint of two codes, or a block near a scale step) or a top-k selection (indexer top-k,
candidate blocks, MoE routing: the k-th and (k+1)-th scores within a few ulp).  The model is chaotic enough
that one such flip moves the step-0 logits by 0.3-4 (the tiny checkpoint's 40-token prompt: an SWA element of
layer 1 three ulp above an E4M3 midpoint, 1.86).  So a logit difference above the noise floor is accepted
only when flipping one near-tie of the reference reproduces it (:func:`explain`).

Near-ties are found generically: a record row is near a boundary when quantising it scaled by 1 +- eps changes
it (eps on :data:`LADDER`, the smallest that flips it is its margin; the flipped row is its alternative); a
selection row when its k-th and (k+1)-th scores differ by less than the largest eps, relatively (exact ties
are left out: every implementation breaks them to the lower index).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_dsv41 import formats
from vllm_dsv41.reference import model as ref

LADDER = (1e-7, 1e-6, 1e-5)
"""Relative perturbations tried on record inputs: about 1, 10 and 100 fp32 ulp."""


@dataclass(frozen=True)
class Flip:
    kind: str  # "record" (a cache-record quantisation) or "top" (a top-k selection)
    call: int  # index of that kind's call in the forward, in execution order
    row: int  # row of the call's input, viewed as [rows, last dim]
    margin: float  # relative perturbation that flips it
    alt: torch.Tensor  # the row's other outcome: record values, or selected indices

    def __str__(self) -> str:
        return f"{self.kind} call {self.call} row {self.row} (margin {self.margin:.1e})"


@contextlib.contextmanager
def _hooked(model: ref.Transformer, on_record: Callable, on_top: Callable):
    """Route the model's record quantisation and ``top_indices`` through the callbacks (call index, input,
    result) -> result."""
    count = {"record": 0, "top": 0}
    orig_q, orig_top = model._q, ref.top_indices

    def q(x: torch.Tensor, kind: str) -> torch.Tensor:
        out = orig_q(x, kind)
        if out is x:  # not quantised (kind "none", or cache_quant off)
            return out
        i, count["record"] = count["record"], count["record"] + 1
        return on_record(i, x, kind, out)

    def top(scores: torch.Tensor, k: int) -> torch.Tensor:
        i, count["top"] = count["top"], count["top"] + 1
        return on_top(i, scores, k, orig_top(scores, k))

    model._q = q
    ref.top_indices = top
    try:
        yield
    finally:
        del model._q
        ref.top_indices = orig_top


def step0_logits(model: ref.Transformer, prompt: list[int]) -> torch.Tensor:
    return model.generate(prompt, 1)[1][0]


def near_ties(model: ref.Transformer, prompt: list[int]) -> list[Flip]:
    """Every near-tie decision of the prompt's prefill, smallest margin first."""
    found: list[Flip] = []

    def on_record(i, x, kind, out):
        D = x.shape[-1]
        base, seen = out.reshape(-1, D), set()
        for eps in LADDER:
            for sign in (1.0, -1.0):
                alt = formats.fake_quant(x * (1.0 + sign * eps), kind).reshape(-1, D)
                for r in (alt != base).any(-1).nonzero().flatten().tolist():
                    if r not in seen:
                        seen.add(r)
                        found.append(Flip("record", i, r, eps, alt[r].clone()))
        return out

    def on_top(i, scores, k, idx):
        if scores.dim() != 2 or scores.shape[-1] <= k:
            return idx
        srt = torch.sort(scores, dim=-1, descending=True, stable=True)
        a, b = srt.values[:, k - 1], srt.values[:, k]
        rel = (a - b) / torch.maximum(a.abs(), b.abs())
        close = torch.isfinite(a) & torch.isfinite(b) & (a > b) & (rel < LADDER[-1])
        for r in close.nonzero().flatten().tolist():
            alt = idx[r].clone()
            alt[k - 1] = srt.indices[r, k]
            found.append(Flip("top", i, r, float(rel[r]), alt))
        return idx

    with _hooked(model, on_record, on_top):
        step0_logits(model, prompt)
    return sorted(found, key=lambda f: f.margin)


def flipped_logits(model: ref.Transformer, prompt: list[int], flip: Flip) -> torch.Tensor:
    """Step-0 logits of the prefill with ``flip``'s decision going the other way."""

    def swap(kind: str):
        def hook(i, x, *rest):
            out = rest[-1]
            if kind != flip.kind or i != flip.call:
                return out
            out = out.clone()
            out.view(-1, out.shape[-1])[flip.row] = flip.alt
            return out
        return hook

    with _hooked(model, swap("record"), swap("top")):
        return step0_logits(model, prompt)


def explain(model: ref.Transformer, prompt: list[int], target: torch.Tensor, tol: float,
            limit: int = 32) -> Flip | None:
    """The first near-tie (smallest margin first, at most ``limit`` tried) whose flip brings the reference's
    step-0 logits within ``tol`` of ``target`` everywhere, or None."""
    for flip in near_ties(model, prompt)[:limit]:
        if (flipped_logits(model, prompt, flip) - target).abs().max().item() < tol:
            return flip
    return None
