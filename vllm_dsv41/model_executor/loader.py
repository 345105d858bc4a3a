"""Checkpoint name -> parameter loading for the vLLM model (official names, dequantised on arrival).

Owns ``load_dsv41_weights``: one rename table, one loop.  FP8 weights (32x32 E8M0
tiles), MXFP4 experts and FP8 Engram rows arrive as a weight plus a ``.scale``
tensor in either order.  A parameter that keeps the quantised bytes (the fast
path, ``linear.py``) takes each tensor as stored; otherwise the pair is
dequantised when both are there.  Anything
the model has no parameter for, a wrong shape, or a scale without its weight is
refused with an error naming the tensor.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import nn

from vllm_dsv41 import formats
from vllm_dsv41.checkpoint import CheckpointError, E8M0, FP8, I8, open_checkpoint

# checkpoint prefix -> module path in the target model
_TARGET_RENAMES = (("layers.", "model.layers."),)
_SKIP_PREFIXES = ("vision.", "aligner.", "image_")


_KEPT_DTYPES = (FP8, I8, torch.uint8)  # parameter dtypes that take the checkpoint's bytes unchanged


def _target_name(name: str) -> str | None:
    if name.startswith(_SKIP_PREFIXES) or name.startswith("mtp."):
        return None
    for old, new in _TARGET_RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _dequant(weight: torch.Tensor, scale: torch.Tensor, engram_rows: bool) -> torch.Tensor:
    if engram_rows:
        return formats.dequant_fp8_rowblock(weight, scale, 32)
    if weight.dtype == FP8:
        return formats.dequant_fp8_block(weight, scale, 32)
    if weight.dtype == I8:
        return formats.dequant_mxfp4(weight, scale)
    raise CheckpointError(f"tensor has a .scale but dtype {weight.dtype}")


def validate_checkpoint_dir(model: nn.Module) -> None:
    """Header-only check of the whole checkpoint (missing / shape / dtype), before any tensor is read."""
    path = model.vllm_config.model_config.model
    if os.path.isdir(path) and any(f.endswith(".safetensors") for f in os.listdir(path)):
        open_checkpoint(path, validate=True, include_draft=False)


def load_dsv41_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], draft: bool,
                       name_map=None) -> set[str]:
    validate_checkpoint_dir(model)
    params = dict(model.named_parameters())
    rename = name_map or _target_name
    pending: dict[str, dict[str, torch.Tensor]] = {}
    loaded: set[str] = set()

    def put(ckpt_name: str, pname: str, value: torch.Tensor) -> None:
        p = params.get(pname)
        if p is None:
            raise CheckpointError(f"checkpoint tensor {ckpt_name!r} has no parameter {pname!r} in the model")
        if tuple(p.shape) != tuple(value.shape):
            raise CheckpointError(f"checkpoint tensor {ckpt_name!r} has shape {list(value.shape)} "
                                  f"(dequantised), expected {list(p.shape)}")
        if p.dtype in _KEPT_DTYPES and value.dtype != p.dtype:
            raise CheckpointError(f"checkpoint tensor {ckpt_name!r} has dtype {value.dtype}, expected {p.dtype}")
        with torch.no_grad():
            p.copy_(value.to(p.dtype))
        loaded.add(pname)

    for name, tensor in weights:
        pname = rename(name)
        if pname is None:
            continue
        p = params.get(pname)
        if p is not None and p.dtype in _KEPT_DTYPES:  # quantised weights kept as stored (linear.py)
            put(name, pname, tensor.view(torch.uint8) if tensor.dtype == E8M0 else tensor)
            continue
        if name.endswith(".scale") or tensor.dtype in (FP8, I8):
            base = name[: -len(".scale")] if name.endswith(".scale") else name[: -len(".weight")]
            slot = pending.setdefault(base, {})
            slot["scale" if name.endswith(".scale") else "weight"] = tensor
            if len(slot) == 2:
                del pending[base]
                value = _dequant(slot["weight"], slot["scale"].view(E8M0) if slot["scale"].dtype != E8M0
                                 else slot["scale"], engram_rows=base.endswith("engram.embed"))
                put(base + ".weight", rename(base + ".weight"), value)
            continue
        put(name, pname, tensor)
    for base, slot in pending.items():
        missing = ".weight" if "weight" not in slot else ".scale"
        raise CheckpointError(f"checkpoint tensor {base + missing!r} is missing (its pair arrived alone)")
    return loaded
