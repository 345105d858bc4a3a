"""The model's view of one engine step: the attention backend's metadata plus per-step scratch.

Owns :class:`Step`, a thin wrapper over ``DSV41StepMetadata`` that adds what the
layers compute once per step and share (top-k selections, candidate blocks) and
the Engram lookback windows built from this step's ids and the runner's history.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_dsv41.attention.backend import DSV41StepMetadata


@dataclass
class Step:
    meta: DSV41StepMetadata
    input_ids: torch.Tensor  # [T] this step's token ids
    scratch: dict = field(default_factory=dict)  # per-step results shared across layers

    @property
    def num_reqs(self) -> int:
        return self.meta.num_reqs

    @property
    def positions(self) -> torch.Tensor:
        return self.meta.positions

    @property
    def req_idx(self) -> torch.Tensor:
        return self.meta.token_req_idx

    @property
    def query_start_loc(self) -> torch.Tensor:
        return self.meta.query_start_loc

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.meta.seq_lens.to(torch.int64)

    @property
    def replay_start(self) -> torch.Tensor:
        return self.meta.replay_start.to(torch.int64)

    def needs_pruning(self, window: int) -> bool:
        """Decoder pruning pays off only when some request brings more than ``window`` rows."""
        return bool((self.meta.query_lens > window).any())

    def group(self, layer_name: str):
        return self.meta.for_layer(layer_name)

    def token_windows(self, depth: int) -> torch.Tensor:
        """[T, depth] ids of positions p, p-1, ..., p-depth+1 of every token; -1 before position 0."""
        T = self.positions.numel()
        out = torch.full((T, depth), -1, dtype=torch.long)
        qsl = self.query_start_loc.tolist()
        look = self.meta.lookback_token_ids.to(torch.long)
        ids = self.input_ids.to(torch.long).cpu()
        for i in range(self.num_reqs):
            a, b = qsl[i], qsl[i + 1]
            if b <= a:
                continue
            hist = torch.cat((look[i, : depth - 1].flip(0), ids[a:b]))  # oldest first
            n0 = depth - 1
            for k in range(depth):
                out[a:b, k] = hist[n0 - k: n0 - k + (b - a)]
        pos = self.positions[:, None] - torch.arange(depth)[None, :]
        return torch.where(pos >= 0, out, torch.full_like(out, -1))
