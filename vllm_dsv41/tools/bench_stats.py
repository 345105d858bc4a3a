"""Pure statistics for ``vllm-dsv41-bench``: percentiles, per-level summaries,
the Pareto frontier of (interactivity, throughput/GPU) and interpolation on it.

Nothing here does I/O; every function is unit-tested on synthetic data.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Iterable, Sequence

# ---------------------------------------------------------------------------
# percentiles


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between
    closest ranks (numpy's default ``linear`` method).  ``None`` when empty;
    NaN/None entries are ignored."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(float(v) for v in values if v is not None and not math.isnan(float(v)))
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return xs[lo] + (xs[hi] - xs[lo]) * frac


def median(values: Iterable[float]) -> float | None:
    return percentile(values, 50.0)


def _scaled(v: float | None, k: float) -> float | None:
    return None if v is None else v * k


# ---------------------------------------------------------------------------
# per-request derived metrics


def request_interactivity(itls_s: Sequence[float]) -> float | None:
    """Interactivity of one request in tokens/s/user: ``1 / median(ITL)``.
    ``None`` when the request streamed fewer than two tokens (no ITL) or the
    median gap is zero (all tokens arrived in one network read)."""
    m = median(itls_s)
    if m is None or m <= 0.0:
        return None
    return 1.0 / m


def tokens_itls(chunk_times: Sequence[float], chunk_tokens: Sequence[int]) -> list[float]:
    """Inter-token latencies from streamed chunks.

    ``chunk_times[i]`` is when chunk ``i`` (carrying ``chunk_tokens[i]`` >= 1
    tokens) arrived.  The first chunk is the first token (TTFT); every later
    chunk contributes ``chunk_tokens[i]`` ITL samples of
    ``(t_i - t_{i-1}) / chunk_tokens[i]`` each, so the distribution is
    token-weighted (a chunk of 3 speculative tokens counts three times)."""
    if len(chunk_times) != len(chunk_tokens):
        raise ValueError("chunk_times and chunk_tokens differ in length")
    out: list[float] = []
    for i in range(1, len(chunk_times)):
        n = int(chunk_tokens[i])
        if n <= 0:
            continue
        gap = max(0.0, chunk_times[i] - chunk_times[i - 1]) / n
        out.extend([gap] * n)
    return out


# ---------------------------------------------------------------------------
# per-level summary


def failure_key(error: Any) -> str:
    """Groups failure messages: numbers become ``N`` except an HTTP status,
    so ``HTTP 500: ... request #17`` and ``... #18`` count as one reason."""
    text = str(error or "unknown")
    m = re.match(r"(HTTP \d+)(.*)", text, re.S)
    head, rest = (m.group(1), m.group(2)) if m else ("", text)
    return (head + re.sub(r"\d+", "N", rest))[:200]

SUMMARY_FIELDS = [
    "concurrency",
    "num_requests",
    "completed",
    "failed",
    "cancelled",
    "failure_rate",
    "partial",
    "wall_time_s",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
    "output_throughput_tok_s",
    "output_throughput_per_gpu",
    "total_throughput_tok_s",
    "request_throughput_req_s",
    "interactivity_median",
    "interactivity_p90",
    "requests_without_itl",
    "itl_median_ms",
    "itl_p90_ms",
    "itl_p99_ms",
    "tpot_median_ms",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "e2e_p50_s",
    "e2e_p90_s",
    "client_cpu_util",
]


def summarize_level(
    records: Sequence[dict[str, Any]],
    *,
    concurrency: int,
    wall_time_s: float,
    gpus: float = 1.0,
    partial: bool = False,
    client_cpu_s: float | None = None,
) -> dict[str, Any]:
    """Summary of one concurrency level from its per-request records.

    Records carry ``status`` (``ok`` | ``failed`` | ``cancelled``),
    ``prompt_tokens``, ``output_tokens``, ``ttft_s``, ``e2e_s``, ``tpot_s``,
    ``itls_s`` (may be absent when not saved), ``itl_median_s`` and
    ``interactivity``.  Throughput counts the output tokens of successful
    requests over the level's wall time.  ``interactivity_p90`` is the
    interactivity that 90% of successful requests met or beat (the 10th
    percentile of the per-request values), i.e. the SLA-style reading.
    Cancelled requests (Ctrl-C) are excluded from every statistic.
    ``client_cpu_util`` is the benchmark process's CPU time over the wall time:
    near 1.0 the client itself is the bottleneck and its ITLs are inflated."""
    if gpus <= 0:
        raise ValueError("gpus must be > 0")
    ok = [r for r in records if r.get("status") == "ok"]
    failed = [r for r in records if r.get("status") == "failed"]
    cancelled = [r for r in records if r.get("status") == "cancelled"]
    attempted = len(ok) + len(failed)
    out_tok = sum(int(r.get("output_tokens") or 0) for r in ok)
    in_tok = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    cached = [r.get("cached_tokens") for r in ok if r.get("cached_tokens") is not None]
    wall = float(wall_time_s)
    tput = out_tok / wall if wall > 0 else None
    inter = [r["interactivity"] for r in ok if r.get("interactivity") is not None]
    # requests whose tokens all reached the client in one network read have no
    # ITL (a server or client stall); they are left out of interactivity
    no_itl = sum(1 for r in ok if r.get("interactivity") is None
                 and int(r.get("output_tokens") or 0) > 1)
    itls: list[float] = []
    for r in ok:
        itls.extend(r.get("itls_s") or [])
    if not itls:  # ITL lists were not saved: fall back to per-request medians
        itls = [r["itl_median_s"] for r in ok if r.get("itl_median_s") is not None]
    ttfts = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    e2es = [r["e2e_s"] for r in ok if r.get("e2e_s") is not None]
    tpots = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    reasons = Counter(failure_key(r.get("error")) for r in failed)
    return {
        "concurrency": int(concurrency),
        "num_requests": attempted,
        "completed": len(ok),
        "failed": len(failed),
        "cancelled": len(cancelled),
        "failure_rate": (len(failed) / attempted) if attempted else 0.0,
        "partial": bool(partial),
        "wall_time_s": wall,
        "input_tokens": in_tok,
        "output_tokens": out_tok,
        "cached_tokens": sum(int(c) for c in cached) if cached else None,
        "output_throughput_tok_s": tput,
        "output_throughput_per_gpu": None if tput is None else tput / gpus,
        "total_throughput_tok_s": (in_tok + out_tok) / wall if wall > 0 else None,
        "request_throughput_req_s": len(ok) / wall if wall > 0 else None,
        "interactivity_median": median(inter),
        "interactivity_p90": percentile(inter, 10.0),
        "requests_without_itl": no_itl,
        "itl_median_ms": _scaled(median(itls), 1e3),
        "itl_p90_ms": _scaled(percentile(itls, 90.0), 1e3),
        "itl_p99_ms": _scaled(percentile(itls, 99.0), 1e3),
        "tpot_median_ms": _scaled(median(tpots), 1e3),
        "ttft_p50_ms": _scaled(percentile(ttfts, 50.0), 1e3),
        "ttft_p90_ms": _scaled(percentile(ttfts, 90.0), 1e3),
        "ttft_p99_ms": _scaled(percentile(ttfts, 99.0), 1e3),
        "e2e_p50_s": percentile(e2es, 50.0),
        "e2e_p90_s": percentile(e2es, 90.0),
        "client_cpu_util": (client_cpu_s / wall) if (client_cpu_s is not None and wall > 0)
        else None,
        "failure_reasons": dict(reasons.most_common()),
    }


# ---------------------------------------------------------------------------
# Pareto frontier and interpolation


def _finite(x: Any) -> bool:
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def pareto_frontier(points: Iterable[Sequence[float]]) -> list[tuple[float, float]]:
    """Non-dominated points of ``(interactivity, throughput)`` pairs.

    A point is on the frontier if no other point is >= in both coordinates and
    > in at least one.  Points with a missing/NaN/inf coordinate are dropped;
    exact duplicates are kept once.  Returned sorted by interactivity
    ascending (so throughput is strictly descending along it)."""
    pts = sorted({(float(p[0]), float(p[1])) for p in points if _finite(p[0]) and _finite(p[1])})
    frontier: list[tuple[float, float]] = []
    # Sweep from highest interactivity down; keep a point when its throughput
    # beats every point with interactivity >= its own.
    best_y = -math.inf
    i = len(pts) - 1
    while i >= 0:
        x = pts[i][0]
        # all points sharing this x: only the max-y one can be on the frontier
        j = i
        while j >= 0 and pts[j][0] == x:
            j -= 1
        y = pts[i][1]  # sorted ascending, so pts[i] has the largest y for this x
        if y > best_y:
            frontier.append((x, y))
            best_y = y
        i = j
    frontier.reverse()
    return frontier


def interpolate_at(
    frontier: Sequence[Sequence[float]], target: float
) -> tuple[float | None, str | None]:
    """Throughput at interactivity ``target``, linearly interpolated along the
    frontier (sorted by interactivity).  Returns ``(value, None)`` or
    ``(None, reason)`` when the target lies outside the measured range: this
    never extrapolates."""
    pts = sorted((float(x), float(y)) for x, y in frontier)
    if not pts:
        return None, "no valid measured points"
    if not _finite(target):
        return None, f"invalid target {target!r}"
    t = float(target)
    lo, hi = pts[0][0], pts[-1][0]
    if t < lo or t > hi:
        side = "below" if t < lo else "above"
        return None, (
            f"target {t:g} tok/s/user is {side} the measured interactivity range "
            f"[{lo:g}, {hi:g}]; not extrapolating"
        )
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= t <= x1:
            if x1 == x0:
                return max(y0, y1), None
            return y0 + (y1 - y0) * (t - x0) / (x1 - x0), None
    # single point equal to the target
    return pts[0][1], None


def level_point(summary: dict[str, Any], stat: str = "median") -> tuple[float, float] | None:
    """``(interactivity, throughput_per_gpu)`` of a level summary, or None."""
    x = summary.get("interactivity_p90" if stat == "p90" else "interactivity_median")
    y = summary.get("output_throughput_per_gpu")
    if not (_finite(x) and _finite(y)) or not summary.get("completed"):
        return None
    return float(x), float(y)


def frontier_report(
    summaries: Sequence[dict[str, Any]], target: float, stat: str = "median"
) -> dict[str, Any]:
    """The ``pareto`` block of results.json."""
    points = []
    for s in summaries:
        p = level_point(s, stat)
        if p is not None:
            points.append({"concurrency": s["concurrency"], "interactivity": p[0],
                           "throughput_per_gpu": p[1], "partial": bool(s.get("partial"))})
    # a level cut short by Ctrl-C is shown but kept off the frontier: the
    # tokens of its cancelled requests are missing from its throughput
    front = pareto_frontier([(p["interactivity"], p["throughput_per_gpu"])
                             for p in points if not p["partial"]])
    on = set(front)
    frontier_pts = []
    for p in points:  # keep the first level of any exact duplicate
        key = (p["interactivity"], p["throughput_per_gpu"])
        if key in on and not p["partial"]:
            frontier_pts.append(p)
            on.discard(key)
    frontier_pts.sort(key=lambda p: p["interactivity"])
    value, reason = interpolate_at(front, target)
    if value is None and points and not front:
        reason = "only partial (interrupted) levels were measured"
    return {
        "interactivity_stat": stat,
        "points": points,
        "frontier": frontier_pts,
        "target_tps_per_user": float(target),
        "throughput_per_gpu_at_target": value,
        "reason": reason,
    }
