"""``ModelConfig``: the model's geometry, one frozen (hashable) pydantic schema.

Every field the user does not set is filled from the chosen preset (``presets.py``), so
``{'preset': 'glm5', 'hidden_size': 1024}`` is the GLM-5 geometry with a smaller hidden
size. Unknown keys are rejected with the closest valid names.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from ula_jax.core.types import KVGeometry
from ula_jax.models.presets import PRESETS

DType = Literal["float32", "bfloat16"]

# Fields that must be >= 1 (sizes and counts).
_POSITIVE = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
    "index_head_dim", "index_topk", "index_share", "intermediate_size",
    "moe_intermediate_size", "num_experts", "num_experts_per_tok", "max_position",
)
_NON_NEGATIVE = ("num_dense_layers", "num_shared_experts", "param_seed")


class ModelConfig(BaseModel):
  """Geometry and numerics of the decoder (DeepSeek-V3.2 / GLM-5 style MLA + DSA).

  Layers ``[0, num_dense_layers)`` use a dense SwiGLU MLP of ``intermediate_size``; the
  others a mixture of experts (``num_experts`` routed, ``num_experts_per_tok`` chosen per
  token, plus ``num_shared_experts`` always on). Layers are split into index-sharing
  groups of ``index_share`` consecutive layers (the last may be shorter); the first layer
  of each group owns a lightning indexer whose top-k selection all layers of the group use.
  """

  model_config = ConfigDict(frozen=True, extra="forbid")

  preset: Literal["tiny", "small", "glm5", "dsv32"] = "tiny"
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_dense_layers: int
  num_heads: int
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  index_n_heads: int
  index_head_dim: int
  index_topk: int
  index_share: int
  intermediate_size: int
  moe_intermediate_size: int
  num_experts: int
  num_experts_per_tok: int
  num_shared_experts: int
  rope_theta: float
  rms_norm_eps: float
  max_position: int
  dtype: DType  # parameters and activations (norms, softmax and logits run in float32)
  kv_dtype: DType  # stored KV entries and indexer keys
  param_seed: int = 0

  @model_validator(mode="before")
  @classmethod
  def _fill_from_preset(cls, data: Any) -> Any:
    if not isinstance(data, Mapping):
      return data
    data = dict(data)
    unknown = [k for k in data if k not in cls.model_fields]
    if unknown:
      names = sorted(cls.model_fields)
      hints = []
      for k in unknown:
        close = difflib.get_close_matches(str(k), names, n=3)
        hints.append(f"model.{k}" + (f" (did you mean {', '.join(close)}?)" if close else ""))
      raise ValueError(f"unknown model field(s): {'; '.join(hints)}; valid fields: "
                       f"{', '.join(names)}")
    preset = data.get("preset", "tiny")
    if preset not in PRESETS:
      raise ValueError(f"model.preset={preset!r}: expected one of {sorted(PRESETS)}")
    return {**PRESETS[preset], **data}

  @model_validator(mode="after")
  def _check(self) -> ModelConfig:
    for name in _POSITIVE:
      v = getattr(self, name)
      if v < 1:
        raise ValueError(f"model.{name}={v}: must be >= 1")
    for name in _NON_NEGATIVE:
      v = getattr(self, name)
      if v < 0:
        raise ValueError(f"model.{name}={v}: must be >= 0")
    for name in ("rope_theta", "rms_norm_eps"):
      v = getattr(self, name)
      if not v > 0:
        raise ValueError(f"model.{name}={v}: must be > 0")
    if self.num_dense_layers > self.num_layers:
      raise ValueError(f"model.num_dense_layers={self.num_dense_layers}: must be <= "
                       f"num_layers={self.num_layers}")
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"model.qk_rope_head_dim={self.qk_rope_head_dim}: must be even "
                       "(RoPE rotates pairs)")
    if self.index_share > self.num_layers:
      raise ValueError(f"model.index_share={self.index_share}: must be between 1 and "
                       f"num_layers={self.num_layers}")
    if self.num_experts_per_tok > self.num_experts:
      raise ValueError(f"model.num_experts_per_tok={self.num_experts_per_tok}: must be <= "
                       f"num_experts={self.num_experts}")
    return self

  # -- derived -----------------------------------------------------------------------

  @property
  def entry_width(self) -> int:
    """Values per token per layer in the KV store: latent + shared rope key."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def num_groups(self) -> int:
    return -(-self.num_layers // self.index_share)

  def group_layers(self, group: int) -> range:
    return range(group * self.index_share,
                 min((group + 1) * self.index_share, self.num_layers))

  @property
  def softmax_scale(self) -> float:
    return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

  def kv_geometry(self) -> KVGeometry:
    """What a memory system needs to know (indexer keys are stored in ``kv_dtype``)."""
    return KVGeometry(num_layers=self.num_layers, group_size=self.index_share,
                      entry_width=self.entry_width, index_dim=self.index_head_dim,
                      top_k=self.index_topk, kv_dtype=self.kv_dtype,
                      index_dtype=self.kv_dtype)
