"""Exact plain-PyTorch reference model (the oracle): see ``reference/model.py``."""

from vllm_dsv41.reference.model import Options, Session, Transformer

__all__ = ["Options", "Session", "Transformer"]
