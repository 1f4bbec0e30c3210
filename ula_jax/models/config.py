"""``ModelConfig``: the model's geometry, one frozen (hashable) pydantic schema.

Every field the user does not set is filled from the chosen preset (``presets.py``), so
``{'preset': 'glm5', 'hidden_size': 1024}`` is the GLM-5 geometry with a smaller hidden
size. Unknown keys are rejected with the closest valid names.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ula_jax.core.kv_layout import EntryLayout, KeyLayout, KVLayoutKind, check_fp8_latent
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
  index_rope_dim: int | None = Field(
      None, description="indexer query and key dimensions rotated by RoPE (the first ones; "
      "DeepSeek-V3.2: 64 of 128), so the indexer can rank by position as well as content; "
      "None = half of index_head_dim, at most 64; 0 = none")
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
  kv_dtype: DType  # stored KV entries (kv_layout 'bf16') and indexer keys
  kv_layout: KVLayoutKind = Field(
      "bf16", description="how KV entries are stored (ula_jax.core.kv_layout): 'bf16' as "
      "kv_lora_rank + qk_rope_head_dim values in kv_dtype (1152 B per token and layer for "
      "512 + 64 in bfloat16); 'fp8' in DeepSeek-V3.2's FP8 layout of 656 B (the latent in "
      "float8_e4m3fn with one float32 scale per 128 values, the rope key in bfloat16), "
      "quantised once when written and dequantised by attention; needs kv_lora_rank a "
      "multiple of 128")
  param_seed: int = 0
  # A directory written by ``checkpoint.save_params`` (``ula-jax train`` writes one as
  # ``<run>/model``), relative to the working directory: the parameters are read from it
  # instead of drawn from ``param_seed``; its geometry must equal this config's.
  checkpoint: str | None = None

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
    if self.kv_layout == "fp8":
      check_fp8_latent(self.kv_lora_rank)
    r = self.index_rope_dim
    if r is not None and (r < 0 or r % 2 or r > self.index_head_dim):
      raise ValueError(f"model.index_rope_dim={r}: must be an even number between 0 and "
                       f"index_head_dim={self.index_head_dim} (or null: half of it, at "
                       f"most 64)")
    return self

  @property
  def index_rope(self) -> int:
    """Indexer dimensions RoPE rotates (``index_rope_dim`` resolved)."""
    if self.index_rope_dim is not None:
      return self.index_rope_dim
    return min(64, self.index_head_dim // 2 // 2 * 2)

  # -- derived -----------------------------------------------------------------------

  @property
  def entry_width(self) -> int:
    """Values of one token's entry per layer: latent + shared rope key (before
    ``kv_layout`` encodes them: ``entry_layout.row_width`` elements are stored)."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def entry_layout(self) -> EntryLayout:
    """How an entry is stored (``kv_layout``): rows of ``row_width`` x ``row_dtype``."""
    return EntryLayout(self.kv_layout, self.kv_lora_rank, self.qk_rope_head_dim,
                       self.kv_dtype)

  @property
  def num_groups(self) -> int:
    return -(-self.num_layers // self.index_share)

  def group_layers(self, group: int) -> range:
    return range(group * self.index_share,
                 min((group + 1) * self.index_share, self.num_layers))

  @property
  def softmax_scale(self) -> float:
    return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

  @property
  def key_layout(self) -> KeyLayout:
    """How an indexer key is stored (``kv_layout``): rows of ``row_width`` x ``row_dtype``
    (K values in kv_dtype, or K + 4 bytes with fp8), decoded into kv_dtype to score."""
    return KeyLayout(self.kv_layout, self.index_head_dim, self.kv_dtype)

  def kv_geometry(self) -> KVGeometry:
    """What a memory system needs to know: pools hold ``entry_layout``'s rows (656 bytes
    with the fp8 layout), indexer key tables ``key_layout``'s rows (132 bytes with fp8)."""
    layout, keys = self.entry_layout, self.key_layout
    return KVGeometry(num_layers=self.num_layers, group_size=self.index_share,
                      entry_width=layout.row_width, index_dim=keys.row_width,
                      top_k=self.index_topk, kv_dtype=layout.row_dtype,
                      index_dtype=keys.row_dtype, layout=layout, index_layout=keys)
