"""A quantisation config that claims V4.1 checkpoints for our model.

vLLM rewrites a V4.1 ``quant_method: fp8`` to its own ``deepseek_v4_fp8`` method, whose linear
methods belong to the built-in model.  Our model holds its own parameters and reads the
FP8/E8M0 and MXFP4 tensors itself, so this config only has to be accepted by the engine
(on every platform, CPU included) and hand out no per-layer methods.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "dsv41_fp8"


def _is_v41(hf_quant_cfg: dict[str, Any]) -> bool:
    return (hf_quant_cfg.get("quant_method") in ("fp8", "deepseek_v4_fp8", NAME)
            and hf_quant_cfg.get("expert_dtype") == "fp4"
            and list(hf_quant_cfg.get("weight_block_size") or []) == [32, 32])


_registered = False


def register_quant_config() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    @register_quantization_config(NAME)
    class DSV41QuantConfig(QuantizationConfig):
        def __init__(self, raw: dict[str, Any] | None = None):
            super().__init__()
            self.raw = raw or {}

        def get_name(self) -> str:
            return NAME

        def get_supported_act_dtypes(self) -> list[torch.dtype]:
            return [torch.float32, torch.bfloat16, torch.float16]

        @classmethod
        def get_min_capability(cls) -> int:
            return 0

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> "DSV41QuantConfig":
            return cls(config)

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
            return NAME if _is_v41(hf_quant_cfg or {}) and user_quant in (None, NAME) else None

        def get_quant_method(self, layer: torch.nn.Module, prefix: str):
            return None
