"""The model: an MLA + DSA-indexer decoder (Flax NNX), its config, and checkpoints.

Submodules: ``config`` (``ModelConfig``), ``presets``, ``layers``, ``transformer``
(``Transformer``, ``decode_step``, ``verify_step``, ``prefill_chunk``,
``decode_dense_reference``), ``mtp`` (the MTP draft block of speculative decoding) and
``checkpoint`` (orbax save/restore, imported on demand).
"""

from __future__ import annotations

from ula_jax.models.config import ModelConfig
from ula_jax.models.presets import PRESETS
from ula_jax.models.transformer import (PrefillWorkspace, Transformer, decode_dense_reference,
                                        decode_step, generate_reference, init_workspace,
                                        prefill_chunk, verify_step)

__all__ = ["PRESETS", "ModelConfig", "PrefillWorkspace", "Transformer",
           "decode_dense_reference", "decode_step", "generate_reference", "init_workspace",
           "prefill_chunk", "verify_step"]
