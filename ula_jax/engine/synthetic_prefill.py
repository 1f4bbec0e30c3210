"""Synthetic prefill (``workload.prefill='synthetic'``): prompt KV from a seeded generator.

Decode at 64K-128K tokens and batch 64+ is what the memory systems are about; computing
those prompts with the model costs far more than decoding them. Synthetic prefill writes
every prompt position's entries and indexer keys from a seeded generator instead, on
the device and at memory speed, through the memory system's ordinary ``write_prefill``
and ``write_index_keys``. No model forward runs.

* **What is generated.** Position ``t`` of a request gets, per layer ``l``, an entry of
  ``entry_width`` independent standard normals (latent and rope part alike) and, per
  layer group ``g``, an indexer key of ``index_dim`` standard normals, stored in
  ``kv_dtype`` / ``index_dtype``. Standard deviation 1 is the scale of the model's own
  entries: the latent and the indexer key leave an RMSNorm (RMS 1), and the rope key is
  the normed hidden state times a ``fan_in ** -0.5`` projection, rotated (std about 1).
  With ``model.kv_layout='fp8'`` (``geo.layout``) the entry's values are rounded to
  bfloat16 and encoded into fp8 rows by the function the model's writes use
  (``core.kv_layout``), so the pools hold the layout's bytes.
* **No locality is built in.** Keys are independent across positions, so which
  positions a decode step selects, and how much consecutive steps' selections overlap,
  comes only from the decode queries. Selections over synthetic keys are not a trained
  model's (nor this model's over its own prompt): hit rates measured on them say how a
  memory system behaves under such selections, not under real serving.
* **The same bits everywhere.** Every value comes from a key folded from (``seed``,
  request key, stream, position, layer or group): entries depend on nothing else, so
  every memory system, chunk length, dp rank and batch gets identical entries, and
  greedy tokens compare exactly across systems. The model's parameters play no part.
* **The prompt's last token.** Synthetic prefill writes positions ``[0, P - 1)``; the
  engine's first decode step of the request takes the prompt's last token at position
  ``P - 1`` (the model computes that entry and key through the normal decode path) and
  its logits give the first generated token. A one-token prompt writes nothing.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp

from ula_jax.core.types import KVGeometry

CHUNK_BYTES = 1 << 30
"""Bytes of entries and indexer keys one synthetic chunk may generate (``chunk_len``):
the chunk is the program's only large temporary, as no activations exist. GLM-5's
geometry (78 layers of 576 bf16 values, 20 groups of 128-wide keys: 95,000 bytes a
token) gets chunks of 8,192 tokens, 0.8 GB."""

NOTE = ("workload.prefill='synthetic': prompt KV entries and indexer keys come from a "
        "seeded generator, not from the model; selections over synthetic keys are not a "
        "trained model's")
"""The line a run with synthetic prefill prints and records (``summary['prefill_note']``)."""

# Streams of one request's key: entries and indexer keys never share a random key.
_ENTRY_STREAM, _INDEX_STREAM = 0, 1


def token_bytes(geo: KVGeometry) -> int:
  """Bytes one prompt position generates: its entry in every layer and key in every group.
  An fp8 entry or key counts as the bfloat16 values it is encoded from (the chunk's
  largest temporary), so a chunk has as many positions as with the bf16 layout."""
  key = geo.index_dim * jnp.dtype(geo.index_dtype).itemsize
  entry = geo.row_bytes
  if geo.layout is not None and geo.layout.kind != "bf16":
    entry = max(entry, geo.layout.width * jnp.dtype(jnp.bfloat16).itemsize)
  if geo.index_layout is not None and geo.index_layout.kind != "bf16":
    key = max(key, geo.index_layout.dim * jnp.dtype(jnp.bfloat16).itemsize)
  return geo.num_layers * entry + geo.num_groups * key


def chunk_len(geo: KVGeometry, prefill_chunk: int, max_context: int,
              budget_bytes: int = CHUNK_BYTES) -> int:
  """Prompt positions per synthetic prefill chunk: the largest power of two whose entries
  and keys fit in ``budget_bytes``, at least ``prefill_chunk`` (``engine.prefill_chunk``)
  and at most ``max_context``. Fewer, larger chunks mean fewer engine steps per prompt;
  a power of two keeps the chunk the same for similar geometries."""
  fit = max(1, budget_bytes // token_bytes(geo))
  return min(max_context, max(prefill_chunk, 1 << (fit.bit_length() - 1)))


def request_key(request_id: str) -> int:
  """A request's 32-bit generator key, from its id (the same id, the same entries)."""
  return int.from_bytes(hashlib.blake2b(str(request_id).encode(), digest_size=4).digest(),
                        "little")


def _seed_key(seed: int) -> jax.Array:
  """A random key of any non-negative ``seed`` (folded in 32-bit words: no overflow)."""
  if seed < 0:
    raise ValueError(f"workload.seed={seed}: must be >= 0")
  key = jax.random.key(0)
  while True:
    key = jax.random.fold_in(key, seed & 0xFFFFFFFF)
    seed >>= 32
    if not seed:
      return key


def _normal_grid(key: jax.Array, rows: int, pos: jax.Array, width: int) -> jax.Array:
  """[rows, C, width] float32 standard normals; value (r, c) from key (pos[c], r)."""
  def one(r, p):
    return jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, p), r), (width,))
  over_pos = jax.vmap(one, in_axes=(None, 0))
  return jax.vmap(over_pos, in_axes=(0, None))(jnp.arange(rows, dtype=jnp.uint32), pos)


def synthetic_chunk(geo: KVGeometry, seed: int, request: jax.Array, start: jax.Array,
                    size: int) -> tuple[jax.Array, jax.Array]:
  """Entries and indexer keys of positions ``start .. start + size - 1`` of a request.

  seed:    ``workload.seed`` (a Python int)
  request: [] the request's key (``request_key``): uint32, or int32 holding its bits
  start:   [] int32 the chunk's first position
  size:    C, positions to generate (static)
  returns (entries [L, C, W]: stored rows (``geo.entry_width`` x ``geo.kv_dtype``, encoded
           by ``geo.layout``), layer-major as ``write_prefill`` takes them;
           keys [G, C, Kr]: stored keys (``geo.index_dim`` x ``geo.index_dtype``, encoded
           by ``geo.index_layout``))

  Position ``t``'s values do not depend on ``start`` or ``size``: any split of a prompt
  into chunks gives the same bits.
  """
  base = jax.random.fold_in(_seed_key(seed), request)  # int32 -> uint32 keeps the bits
  pos = (jnp.asarray(start, jnp.int32) + jnp.arange(size, dtype=jnp.int32)).astype(jnp.uint32)
  layout = geo.layout
  width = geo.entry_width if layout is None else layout.width  # values, before encoding
  entries = _normal_grid(jax.random.fold_in(base, _ENTRY_STREAM), geo.num_layers, pos, width)
  if layout is not None and layout.kind != "bf16":
    entries = layout.encode(entries.astype(jnp.bfloat16))
  klayout = geo.index_layout
  keys = _normal_grid(jax.random.fold_in(base, _INDEX_STREAM), geo.num_groups, pos,
                      geo.index_dim if klayout is None else klayout.dim)
  if klayout is not None and klayout.kind != "bf16":
    keys = klayout.encode(keys.astype(jnp.bfloat16))
  return entries.astype(geo.kv_dtype), keys.astype(geo.index_dtype)
