"""Seeded synthetic workloads for ``vllm-dsv41-bench``.

Prompts are token-id lists, so input lengths are exact without a tokenizer.
Every random draw comes from a NumPy generator seeded by a tuple
``(seed, stream tag, concurrency, index, ...)``: the same seed gives the same
requests on any server, and different concurrency levels draw disjoint
prompts, so one level never warms the prefix cache for the next.

``random``  -- fixed-length random prompts (the common decode benchmark,
               e.g. 4096 in / 1024 out with ``ignore_eos``).
``agentic`` -- multi-turn sessions: turn k's prompt is turn k-1's prompt +
               turn k-1's output + new "user/tool" tokens, so prefix caching
               matters; lognormal turn counts and lengths, exponential think
               time between turns, an optional prefix shared by all sessions
               of a level (system prompt + tool definitions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# stream tags keep the independent random streams apart
_TAG_RANDOM = 1
_TAG_SESSION = 2
_TAG_USER = 3
_TAG_STANDIN = 4
_TAG_SHARED = 5
_TAG_WARMUP = 6


def default_vocab_range(vocab_size: int) -> tuple[int, int]:
    """``[100, vocab_size - 100)``: keeps clear of the special tokens that
    tokenizers usually put at either end of the vocabulary."""
    lo, hi = 100, int(vocab_size) - 100
    if hi <= lo:
        raise ValueError(f"--vocab-size {vocab_size} is too small (need > 200)")
    return lo, hi


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, *[int(k) & 0xFFFFFFFF for k in key]])


def random_ids(rng: np.random.Generator, n: int, vocab: tuple[int, int]) -> list[int]:
    """``n`` ids uniform in ``[vocab[0], vocab[1])``."""
    return rng.integers(vocab[0], vocab[1], size=int(n), dtype=np.int64).tolist()


def lognormal_len(rng: np.random.Generator, median: float, sigma: float,
                  lo: int = 1, hi: int | None = None) -> int:
    """A lognormal integer with the given median, clamped to ``[lo, hi]``."""
    v = median if sigma <= 0 else float(rng.lognormal(math.log(median), sigma))
    n = max(lo, int(round(v)))
    return n if hi is None else min(n, hi)


def warmup_prompt(seed: int, index: int, vocab: tuple[int, int], n: int = 64) -> list[int]:
    return random_ids(_rng(seed, _TAG_WARMUP, index), n, vocab)


# ---------------------------------------------------------------------------
# random


@dataclass(frozen=True)
class RandomWorkload:
    input_len: int
    output_len: int
    vocab: tuple[int, int]
    seed: int = 0

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("random workload needs --input-len >= 1 and --output-len >= 1")

    def prompt(self, concurrency: int, index: int) -> list[int]:
        """Prompt of request ``index`` at the given concurrency level."""
        return random_ids(_rng(self.seed, _TAG_RANDOM, concurrency, index), self.input_len, self.vocab)

    def describe(self) -> dict:
        return {"input_len": self.input_len, "output_len": self.output_len,
                "vocab_range": list(self.vocab), "seed": self.seed}


# ---------------------------------------------------------------------------
# agentic


@dataclass(frozen=True)
class TurnPlan:
    new_input_len: int   # tokens appended by the user/tool this turn
    output_len: int      # exact tokens the server must generate
    think_time_s: float  # pause before sending this turn (0 for turn 0)


@dataclass(frozen=True)
class SessionPlan:
    concurrency: int
    session: int
    turns: tuple[TurnPlan, ...]

    def prompt_lens(self, shared_prefix_len: int) -> list[int]:
        """Exact prompt length of every turn."""
        out, ctx = [], shared_prefix_len
        for k, t in enumerate(self.turns):
            if k:
                ctx += self.turns[k - 1].output_len
            ctx += t.new_input_len
            out.append(ctx)
        return out


@dataclass(frozen=True)
class AgenticWorkload:
    vocab: tuple[int, int]
    seed: int = 0
    shared_prefix_len: int = 2048
    first_turn_len: int = 4096      # median new tokens of turn 0
    turn_input_len: int = 1024      # median new tokens of later turns
    turn_output_len: int = 512      # median output tokens per turn
    turns: int = 8                  # median turns per session
    max_turns: int = 32
    len_sigma: float = 0.6
    turns_sigma: float = 0.5
    max_context: int = 65536        # prompt + output never exceeds this
    think_time_scale: float = 1.0   # mean of the exponential think time (s)

    def __post_init__(self) -> None:
        if min(self.first_turn_len, self.turn_input_len, self.turn_output_len, self.turns,
               self.max_turns) < 1:
            raise ValueError("agentic lengths and turn counts must be >= 1")
        if self.shared_prefix_len < 0 or self.think_time_scale < 0:
            raise ValueError("--shared-prefix-len and --think-time-scale must be >= 0")
        if self.shared_prefix_len + 2 > self.max_context:
            raise ValueError("--max-context too small for --shared-prefix-len")

    def describe(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    def shared_prefix(self, concurrency: int) -> list[int]:
        return random_ids(_rng(self.seed, _TAG_SHARED, concurrency), self.shared_prefix_len, self.vocab)

    def session_plan(self, concurrency: int, session: int) -> SessionPlan:
        """Turn count, lengths and think times of one session (deterministic)."""
        rng = _rng(self.seed, _TAG_SESSION, concurrency, session)
        n_turns = lognormal_len(rng, self.turns, self.turns_sigma, 1, self.max_turns)
        turns: list[TurnPlan] = []
        ctx = self.shared_prefix_len
        for k in range(n_turns):
            med_in = self.first_turn_len if k == 0 else self.turn_input_len
            new_in = lognormal_len(rng, med_in, self.len_sigma)
            out = lognormal_len(rng, self.turn_output_len, self.len_sigma)
            think = float(rng.exponential(self.think_time_scale)) if (k and self.think_time_scale > 0) else 0.0
            if k:
                ctx += turns[-1].output_len
            if ctx + new_in + out > self.max_context:
                if k:
                    break  # the context is full: the session ends here
                # first turn: shrink it to fit
                out = min(out, max(1, (self.max_context - ctx) // 4))
                new_in = max(1, self.max_context - ctx - out)
            ctx += new_in
            turns.append(TurnPlan(new_in, out, think))
        return SessionPlan(concurrency, session, tuple(turns))

    def user_tokens(self, concurrency: int, session: int, turn: int, n: int) -> list[int]:
        return random_ids(_rng(self.seed, _TAG_USER, concurrency, session, turn), n, self.vocab)

    def standin_output(self, concurrency: int, session: int, turn: int, n: int) -> list[int]:
        """Deterministic stand-in for a turn's output when the server does not
        return token ids."""
        return random_ids(_rng(self.seed, _TAG_STANDIN, concurrency, session, turn), n, self.vocab)

    def session(self, concurrency: int, session: int) -> "AgenticSession":
        return AgenticSession(self, self.session_plan(concurrency, session))


@dataclass
class AgenticSession:
    """Builds the prompts of one session turn by turn.

    Call ``prompt(k)`` then ``record_output(k, ids_or_None)`` for k = 0, 1, ...
    """

    workload: AgenticWorkload
    plan: SessionPlan
    context: list[int] = field(default_factory=list)
    _pending_output: list[int] | None = None
    _next_turn: int = 0
    last_prefix_len: int = 0
    feedback: list[str] = field(default_factory=list)  # per turn: returned|synthetic

    @property
    def num_turns(self) -> int:
        return len(self.plan.turns)

    def prompt(self, turn: int) -> list[int]:
        if turn != self._next_turn:
            raise ValueError(f"turns must be taken in order: expected {self._next_turn}, got {turn}")
        w, p = self.workload, self.plan
        if turn == 0:
            ctx = w.shared_prefix(p.concurrency)
        else:
            if self._pending_output is None:
                raise ValueError("record_output() of the previous turn was not called")
            ctx = self.context + self._pending_output
        # tokens of this prompt already sent in earlier requests: the shared
        # prefix for turn 0, the previous prompt + its output after that
        self.last_prefix_len = len(ctx)
        ctx = ctx + w.user_tokens(p.concurrency, p.session, turn, p.turns[turn].new_input_len)
        self.context = ctx
        self._pending_output = None
        self._next_turn = turn + 1
        return ctx

    def record_output(self, turn: int, token_ids: list[int] | None) -> str:
        """Remember turn ``turn``'s output; falls back to a deterministic
        stand-in of the planned length when ``token_ids`` is missing or of the
        wrong length.  Returns ``"returned"`` or ``"synthetic"``."""
        n = self.plan.turns[turn].output_len
        if token_ids is not None and len(token_ids) == n:
            self._pending_output, kind = list(token_ids), "returned"
        else:
            p = self.plan
            self._pending_output = self.workload.standin_output(p.concurrency, p.session, turn, n)
            kind = "synthetic"
        self.feedback.append(kind)
        return kind
