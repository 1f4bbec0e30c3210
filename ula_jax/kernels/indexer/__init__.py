"""Indexer scoring and top-k selection."""

from ula_jax.kernels.indexer.reference import index_scores, select_topk

__all__ = ["index_scores", "select_topk"]
