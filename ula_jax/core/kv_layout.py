"""How one token's KV entry of one layer is stored: ``model.kv_layout``.

An entry is ``concat(c [C], k_rope [R])``: the MLA latent (C = ``kv_lora_rank``) and
the shared rotary key (R = ``qk_rope_head_dim``); 512 + 64 = 576 values in GLM-5 and
DeepSeek-V3.2. A memory system stores it as one opaque row; the model writes rows with
``encode`` and attention reads them back with ``decode`` after the gather.

* ``bf16``: the C + R values in ``model.kv_dtype`` (1,152 B for 576 bfloat16 values).
* ``fp8``: DeepSeek-V3.2's FP8 layout (as in FlashMLA and SGLang's NSA backend), a row of
  ``C + 4 C / 128 + 2 R`` bytes (656 B for 512 + 64), little-endian:

  ==============================  ===============================================
  bytes ``[0, C)``                the latent in float8_e4m3fn, block ``j`` of 128
                                  values divided by its scale
  bytes ``[C, C + 4 C/128)``      the C / 128 block scales, float32:
                                  ``amax(|block|) * (1 / 448)`` (448: e4m3fn's
                                  largest value)
  bytes ``[C + 4 C/128, end)``    k_rope in bfloat16 (not quantised)
  ==============================  ===============================================

  The scale is a product with the float32 reciprocal (XLA turns a division by a
  constant into that product anyway; written out, every backend rounds it alike). A
  block of zeros has scale 0 and decodes to zeros. Decoding rounds once (``fp8 *
  scale``), so the same row gives the same values everywhere.

Entries are encoded once, where the model produces them; every memory system then holds
the same bytes, and prefill, decode and the dense reference attend over the same values.

Indexer keys (``KeyLayout``) follow the same kind: with ``bf16`` a key is its K values in
``model.kv_dtype``; with ``fp8`` DeepSeek-V3.2's indexer-cache row of ``K + 4`` bytes
(132 B for K = 128): the key in float8_e4m3fn divided by one float32 scale
(``amax(|key|) * (1 / 448)``), then the scale. Keys are decoded back into
``model.kv_dtype`` values before the indexer scores them, where the model writes them
(prefill's workspace, the dense reference) and where a memory system reads them (a
decode step's selection), so every path scores the same values.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

KVLayoutKind = Literal["bf16", "fp8"]
KINDS: tuple[str, ...] = ("bf16", "fp8")
FP8_BLOCK = 128  # latent values per float32 scale
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
_INV_FP8_MAX = np.float32(1.0 / FP8_MAX)  # numpy: nothing starts a backend at import
_F32, _U8 = jnp.float32, jnp.uint8


def check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"model.kv_layout={kind!r}: expected one of {list(KINDS)}")


def check_fp8_latent(latent_dim: int) -> None:
  """Raises where the fp8 layout cannot hold a latent of ``latent_dim`` values."""
  if latent_dim % FP8_BLOCK:
    raise ValueError(
        f"model.kv_layout='fp8' quantises the latent in blocks of {FP8_BLOCK} values with "
        f"one scale each: model.kv_lora_rank={latent_dim} must be a multiple of "
        f"{FP8_BLOCK} (or set model.kv_layout='bf16')")


def check_fp8_pool(pool: jax.Array, latent_dim: int, rope_dim: int) -> None:
  """Raises where ``pool`` is not a pool of fp8 rows [S, C + 4 C/128 + 2 R] uint8."""
  W = row_width("fp8", latent_dim, rope_dim)
  if pool.ndim != 2 or pool.shape[1] != W or pool.dtype != _U8:
    raise ValueError(f"pool: got {pool.dtype}{list(pool.shape)}, expected uint8 "
                     f"[S, Dl + 4 Dl/128 + 2 Dr] = [S, {W}] (model.kv_layout='fp8')")


def row_width(kind: str, latent_dim: int, rope_dim: int) -> int:
  """Elements of one stored row: ``C + R`` values (bf16), ``C + 4 C/128 + 2 R`` bytes (fp8)."""
  check_kind(kind)
  if kind == "bf16":
    return latent_dim + rope_dim
  check_fp8_latent(latent_dim)
  return latent_dim + 4 * (latent_dim // FP8_BLOCK) + 2 * rope_dim


def _quantize_blocks(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Blocks [..., nb, B] (float32) into their float8_e4m3fn bytes [..., nb, B] over one
  scale per block, ``amax * (1 / 448)``, and the scales' bytes [..., nb, 4]."""
  scale = jnp.max(jnp.abs(x), axis=-1) * _INV_FP8_MAX  # [..., nb]
  # amax / (amax / 448) may round just above 448: clip so it never overflows to NaN.
  q = jnp.clip(x / jnp.where(scale > 0, scale, 1.0)[..., None], -FP8_MAX, FP8_MAX)
  return (jax.lax.bitcast_convert_type(q.astype(jnp.float8_e4m3fn), _U8),
          jax.lax.bitcast_convert_type(scale, _U8))


def _dequantize_blocks(q_bytes: jax.Array, s_bytes: jax.Array) -> jax.Array:
  """``_quantize_blocks``'s bytes back: [..., nb, B] and [..., nb, 4] -> [..., nb, B]
  float32, one rounding (``fp8 * scale``)."""
  q = jax.lax.bitcast_convert_type(q_bytes, jnp.float8_e4m3fn).astype(_F32)
  return q * jax.lax.bitcast_convert_type(s_bytes, _F32)[..., None]


def quantize(entry: jax.Array, latent_dim: int) -> jax.Array:
  """Entries into fp8 rows.

  entry:   [..., C + R] any float dtype (C = latent_dim, a multiple of 128)
  returns  [..., C + 4 C/128 + 2 R] uint8
  """
  check_fp8_latent(latent_dim)
  lead, C = entry.shape[:-1], latent_dim
  nb = C // FP8_BLOCK
  lat = entry[..., :C].astype(_F32).reshape(*lead, nb, FP8_BLOCK)
  q_bytes, s_bytes = _quantize_blocks(lat)  # [..., nb, 128], [..., nb, 4]
  r_bytes = jax.lax.bitcast_convert_type(entry[..., C:].astype(jnp.bfloat16), _U8)
  return jnp.concatenate([q_bytes.reshape(*lead, C), s_bytes.reshape(*lead, 4 * nb),
                          r_bytes.reshape(*lead, 2 * (entry.shape[-1] - C))], axis=-1)


def dequantize(rows: jax.Array, latent_dim: int) -> jax.Array:
  """fp8 rows back into entries.

  rows:    [..., C + 4 C/128 + 2 R] uint8 (C = latent_dim)
  returns  [..., C + R] float32
  """
  check_fp8_latent(latent_dim)
  lead, C = rows.shape[:-1], latent_dim
  nb = C // FP8_BLOCK
  R2 = rows.shape[-1] - C - 4 * nb
  if rows.dtype != _U8 or R2 < 0 or R2 % 2:
    raise ValueError(f"rows: got {rows.dtype}{list(rows.shape)}, expected uint8 "
                     f"[..., {C} + {4 * nb} + 2 R] (model.kv_layout='fp8')")
  lat = _dequantize_blocks(rows[..., :C].reshape(*lead, nb, FP8_BLOCK),
                          rows[..., C:C + 4 * nb].reshape(*lead, nb, 4)).reshape(*lead, C)
  rope = jax.lax.bitcast_convert_type(rows[..., C + 4 * nb:].reshape(*lead, R2 // 2, 2),
                                      jnp.bfloat16)
  return jnp.concatenate([lat, rope.astype(_F32)], axis=-1)


def quantize_key(key: jax.Array) -> jax.Array:
  """Indexer keys into fp8 rows: [..., K] any float dtype -> [..., K + 4] uint8 (the K
  values in float8_e4m3fn over one float32 scale per key, then the scale's bytes)."""
  q_bytes, s_bytes = _quantize_blocks(key.astype(_F32)[..., None, :])  # the key: one block
  return jnp.concatenate([q_bytes[..., 0, :], s_bytes[..., 0, :]], axis=-1)


def dequantize_key(rows: jax.Array) -> jax.Array:
  """fp8 key rows [..., K + 4] uint8 back into keys [..., K] float32."""
  if rows.dtype != _U8 or rows.shape[-1] < 5:
    raise ValueError(f"rows: got {rows.dtype}{list(rows.shape)}, expected uint8 [..., K + 4] "
                     f"(model.kv_layout='fp8' indexer keys)")
  return _dequantize_blocks(rows[..., None, :-4], rows[..., None, -4:])[..., 0, :]


def encode(entry: jax.Array, kind: str, latent_dim: int, dtype) -> jax.Array:
  """Entries [..., C + R] into stored rows: ``dtype`` values (bf16) or fp8 rows (uint8)."""
  check_kind(kind)
  return entry.astype(dtype) if kind == "bf16" else quantize(entry, latent_dim)


def decode(rows: jax.Array, kind: str, latent_dim: int) -> jax.Array:
  """Stored rows into entries [..., C + R] float32 (the inverse of ``encode`` up to its
  rounding)."""
  check_kind(kind)
  return rows.astype(_F32) if kind == "bf16" else dequantize(rows, latent_dim)


@dataclasses.dataclass(frozen=True)
class EntryLayout:
  """The stored form of one layer's entry of one token (static, hashable).

  kind:       ``model.kv_layout``
  latent_dim: C (``kv_lora_rank``); rope_dim: R (``qk_rope_head_dim``)
  dtype:      the values' dtype under ``bf16`` (``model.kv_dtype``); ``fp8`` rows are bytes
  """

  kind: str
  latent_dim: int
  rope_dim: int
  dtype: str = "bfloat16"

  def __post_init__(self):
    row_width(self.kind, self.latent_dim, self.rope_dim)  # validates

  @property
  def width(self) -> int:
    """Values of one entry: C + R."""
    return self.latent_dim + self.rope_dim

  @property
  def row_width(self) -> int:
    """Elements of one stored row (of ``row_dtype``)."""
    return row_width(self.kind, self.latent_dim, self.rope_dim)

  @property
  def row_dtype(self) -> str:
    return self.dtype if self.kind == "bf16" else "uint8"

  @property
  def row_bytes(self) -> int:
    return self.row_width * jnp.dtype(self.row_dtype).itemsize

  def encode(self, entry: jax.Array) -> jax.Array:
    """[..., C + R] float -> [..., row_width] row_dtype."""
    return encode(entry, self.kind, self.latent_dim, self.dtype)

  def decode(self, rows: jax.Array) -> jax.Array:
    """[..., row_width] -> [..., C + R] float32."""
    return decode(rows, self.kind, self.latent_dim)


@dataclasses.dataclass(frozen=True)
class KeyLayout:
  """The stored form of one indexer key of one token (static, hashable).

  kind:  ``model.kv_layout``; dim: K (``index_head_dim``)
  dtype: the keys' dtype, stored under ``bf16`` and decoded into under either kind
         (``model.kv_dtype``)
  """

  kind: str
  dim: int
  dtype: str = "bfloat16"

  def __post_init__(self):
    check_kind(self.kind)
    if self.dim < 1:
      raise ValueError(f"model.index_head_dim={self.dim}: must be >= 1")

  @property
  def row_width(self) -> int:
    """Elements of one stored key (of ``row_dtype``): K values, or K + 4 bytes (fp8)."""
    return self.dim if self.kind == "bf16" else self.dim + 4

  @property
  def row_dtype(self) -> str:
    return self.dtype if self.kind == "bf16" else "uint8"

  @property
  def row_bytes(self) -> int:
    return self.row_width * jnp.dtype(self.row_dtype).itemsize

  def encode(self, key: jax.Array) -> jax.Array:
    """[..., K] float -> [..., row_width] row_dtype."""
    return key.astype(self.dtype) if self.kind == "bf16" else quantize_key(key)

  def decode(self, rows: jax.Array) -> jax.Array:
    """[..., row_width] -> [..., K] in ``dtype`` (the values the indexer scores)."""
    if self.kind == "bf16":
      return rows.astype(self.dtype)
    return dequantize_key(rows).astype(self.dtype)
