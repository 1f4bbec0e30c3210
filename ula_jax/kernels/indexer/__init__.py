"""Indexer scoring and top-k selection.

``index_scores`` and ``select_topk`` (``reference.py``) score and select for decode, one
row per request; ``prefix_topk`` (``prefill.py``) selects for a prefill chunk, every
row its own top-k over its prefix, in row blocks within a memory budget, scored by
``kernels.indexer`` (``blocked.py`` jnp, ``pallas.py`` Triton) and selected by radix
select (``topk.py``).
"""

from ula_jax.kernels.indexer.prefill import SCRATCH_BYTES, prefix_topk
from ula_jax.kernels.indexer.reference import index_scores, select_topk

__all__ = ["SCRATCH_BYTES", "index_scores", "prefix_topk", "select_topk"]
