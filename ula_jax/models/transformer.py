"""The decoder and its three ways of running.

* ``decode_step``: one token per batch row, KV through a memory system (``core.types.DecodeMemory``) (the engine's
  decode, inside ``shard_map``), sparse attention in absorbed form over resolved slots.
* ``prefill_chunk``: one chunk of one request's prompt over a dense per-request
  ``PrefillWorkspace``; returns the entries and indexer keys the engine hands to the
  memory system.
* ``decode_dense_reference``: one token per row over batched workspaces, dense
  non-absorbed attention masked to the indexer's selection (a check for the other two).

All three run the same layer stack (``_run_layers``) and indexer (``index_scores`` then
``select_topk``); they differ only in where KV lives and how attention reads it. Prefill
and decode share the attention function too, so decoding token t after prefilling
positions < t gives the logits that prefilling t would (up to float32 rounding).

Layer l belongs to index-sharing group ``l // index_share``; the group's first layer
computes the selection that every layer of the group attends over.

Tensor parallelism (``decode_step(..., tp_axis='tp')`` inside ``shard_map``): each rank
of the axis computes the queries, absorbed attention and output projection of its
``H / tp`` heads over the same selected entries, and the ranks' shares of the
attention output are summed (``tp_sum``). Parameters stay whole on every rank; the
indexer, norms and feed-forward layers run replicated, so every rank holds the same
hidden state, selection and entries.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from ula_jax.kernels.sparse_attention import sparse_mla_attention
from ula_jax.core.addressing import addrs_of_positions
from ula_jax.core.types import INVALID, DecodeMemory, Resolution
from ula_jax.models.config import ModelConfig
from ula_jax.kernels.indexer import index_scores, select_topk
from ula_jax.models.layers import (F32, MLP, HeadRange, Indexer, MLAttention, MoE, RMSNorm,
                                   normal_param)


class Projection(NamedTuple):
  """What a layer computes before attention (``DecoderLayer.pre_attention``)."""

  h: jax.Array  # [N, D] normed layer input (the group's indexer reads it too)
  c_q: jax.Array  # [N, Q] q latent
  q_nope: jax.Array  # [N, H, dn] (H: this rank's heads under tensor parallelism)
  q_rope: jax.Array  # [N, H, dr], rotated
  entry: jax.Array  # [N, W] concat(c, k_rope) in kv_dtype


class DecoderLayer(nnx.Module):
  """RMSNorm -> MLA -> residual -> RMSNorm -> MLP (dense layers) or MoE -> residual."""

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
    self.attn = MLAttention(cfg, rngs=rngs)
    self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
    self.ffn = (MLP(cfg.hidden_size, cfg.intermediate_size, cfg.dtype, rngs=rngs)
                if layer < cfg.num_dense_layers else MoE(cfg, rngs=rngs))

  def pre_attention(self, x_nd: jax.Array, pos_n: jax.Array,
                    heads: HeadRange | None = None) -> Projection:
    h_nd = self.attn_norm(x_nd)
    return Projection(h_nd, *self.attn.project(h_nd, pos_n, heads))

  def post_attention(self, x_nd: jax.Array, attn_nd: jax.Array) -> jax.Array:
    x_nd = x_nd + attn_nd
    return x_nd + self.ffn(self.ffn_norm(x_nd))


class Transformer(nnx.Module):
  """Embedding, decoder layers, one indexer per layer group, final norm, LM head.

  ``rngs`` defaults to ``nnx.Rngs(cfg.param_seed)``: the same config gives the same
  parameters.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None):
    rngs = nnx.Rngs(cfg.param_seed) if rngs is None else rngs
    self.cfg = cfg
    self.embed = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), 1, cfg.dtype, std=1.0)
    self.layers = nnx.List([DecoderLayer(cfg, l, rngs=rngs) for l in range(cfg.num_layers)])
    self.indexers = nnx.List([Indexer(cfg, rngs=rngs) for _ in range(cfg.num_groups)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
    self.lm_head = normal_param(rngs, (cfg.hidden_size, cfg.vocab_size), cfg.hidden_size,
                          cfg.dtype)

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """[N] int32 -> [N, D]."""
    return self.embed[...][tokens]

  def logits(self, x_nd: jax.Array) -> jax.Array:
    """[N, D] final hidden -> [N, V] float32."""
    return jnp.einsum("nd,dv->nv", self.final_norm(x_nd), self.lm_head[...],
                      preferred_element_type=F32)


def _run_layers(model: Transformer, x_nd: jax.Array, pos_n: jax.Array, *,
                select: Callable[[int, Projection, Indexer], Any],
                attend: Callable[[int, DecoderLayer, Projection, Any], jax.Array],
                heads: HeadRange | None = None) -> jax.Array:
  """The layer stack, shared by every way of running the model.

  Per group g: ``sel = select(g, first-layer projection, indexer)``; then per layer l of
  the group, ``attend(l, layer, projection, sel)`` gives the attention output [N, D].
  The callbacks own the KV storage (and thread their state through closures).
  heads: the heads whose queries the projections hold (None = all).
  """
  cfg = model.cfg
  for g in range(cfg.num_groups):
    group = cfg.group_layers(g)
    first = model.layers[group[0]].pre_attention(x_nd, pos_n, heads)
    sel = select(g, first, model.indexers[g])
    for l in group:
      layer = model.layers[l]
      proj = first if l == group[0] else layer.pre_attention(x_nd, pos_n, heads)
      x_nd = layer.post_attention(x_nd, attend(l, layer, proj, sel))
  return x_nd


def tp_sum(x: jax.Array, axis: str) -> jax.Array:
  """Sum of ``x`` over the ranks of mesh ``axis`` (inside ``shard_map``), in rank order.

  An all-gather then a local sum rather than a ``psum``: every rank runs the same
  reduction over the same operands, so the result has the same bits on every rank and
  under any placement of the ranks in processes (a psum's order is the collective
  implementation's). The ranks must agree bit for bit: each one runs the indexer and
  the memory system's resolve on this hidden state, and they must choose alike.
  x: [...] -> [...] the same shape and dtype
  """
  return jnp.sum(jax.lax.all_gather(x, axis), axis=0).astype(x.dtype)


def _absorbed_attention(layer: DecoderLayer, proj: Projection, pool: jax.Array,
                        slots: jax.Array, valid: jax.Array, scale: float,
                        impl: str, heads: HeadRange | None = None,
                        tp_axis: str | None = None) -> jax.Array:
  """Sparse absorbed-form MLA over ``pool[slots]``: [N, D].

  With ``heads`` and ``tp_axis``, ``proj`` holds this rank's heads; their share of the
  output is accumulated in float32 and summed over the ``tp_axis`` ranks.
  """
  o_lat = sparse_mla_attention(layer.attn.absorb(proj.q_nope, heads), proj.q_rope, pool,
                               slots, valid, scale=scale, impl=impl)
  if tp_axis is None:
    return layer.attn.out(o_lat)
  share_nd = layer.attn.out(o_lat, heads, dtype=F32)
  return tp_sum(share_nd, tp_axis).astype(layer.attn.w_o[...].dtype)


def tp_heads(num_heads: int, tp_axis: str) -> HeadRange:
  """This rank's heads when ``num_heads`` are split evenly over mesh axis ``tp_axis``
  (inside ``shard_map``); ValueError when the axis size does not divide them."""
  tp = jax.lax.axis_size(tp_axis)
  if num_heads % tp:
    raise ValueError(f"model.num_heads={num_heads} is not divisible by the {tp_axis!r} mesh "
                     f"axis size {tp}: attention heads are split evenly over its ranks")
  count = num_heads // tp
  return HeadRange(jax.lax.axis_index(tp_axis).astype(jnp.int32) * count, count)


# ----------------------------------------------------------------------------------
# Decode through a memory system
# ----------------------------------------------------------------------------------


def _add_stats(total: dict, new: dict) -> dict:
  out = dict(total)
  for k, v in new.items():
    out[k] = out.get(k, jnp.int32(0)) + jnp.asarray(v, jnp.int32)
  return out


def decode_step(model: Transformer, mem: DecodeMemory, mem_state, tokens: jax.Array,
                positions: jax.Array, page_table: jax.Array, active: jax.Array, *,
                attention: str = "xla", tp_axis: str | None = None,
                return_selection: bool = False):
  """Decodes one token per row; KV lives in ``mem`` (one device's local state).

  tokens:     [B] int32 the token being decoded
  positions:  [B] int32 its position (= the number of tokens before it)
  page_table: [B, P] int32 logical pages of each row (INVALID where unallocated)
  active:     [B] bool; inactive rows write nothing and give finite garbage logits
  attention:  sparse attention implementation (``kernels.sparse_attention.IMPLS``)
  tp_axis:    mesh axis the attention heads are split over (inside ``shard_map``;
              ``model.num_heads`` must be a multiple of its size); None = every head
              here, the numerics of a single device
  return_selection: also return the step's selections, for trace recording
  returns (logits [B, V] float32, mem_state, stats: dict[str, int32 scalar] summed
           over layer groups); with ``tp_axis`` the same on every rank of the axis.
           With ``return_selection``, a fourth value: {"sel_addr": [G, B, k] int32,
           "sel_valid": [G, B, k] bool, "new_addr": [B] int32}

  Calls ``mem`` in the order ``memory/base.py`` documents: per group, write and read
  the index keys, select (``mem.select``), resolve, move every layer of the group, then per layer write
  the new entry and attend over ``read_pool`` at the resolved slots. Every rank of
  ``tp_axis`` makes the same calls with the same arguments: a memory system may use
  collectives over the axis in any of them (e.g. scoring its share of the keys in
  ``select``), and must hand every rank the same entries to attend over
  (``read_pool(state, l)[res.slots]``, wherever each rank keeps them).
  """
  cfg = model.cfg
  heads = None if tp_axis is None else tp_heads(cfg.num_heads, tp_axis)
  ps = mem.page_size
  positions = positions.astype(jnp.int32)
  new_addr = addrs_of_positions(page_table, positions[:, None], ps)[:, 0]
  new_addr = jnp.where(active, new_addr, INVALID)
  stats: dict = {}
  selections: list[tuple[jax.Array, jax.Array]] = []

  def select(g: int, first: Projection, indexer: Indexer) -> Resolution:
    nonlocal mem_state, stats
    mem_state = mem.write_index_keys(mem_state, g, new_addr, indexer.key(first.h))
    q_I, w = indexer.query(first.h, first.c_q)
    sel_pos, sel_valid = mem.select(mem_state, g, q_I, w, page_table, positions, active)
    sel_addr = jnp.where(sel_valid, addrs_of_positions(page_table, sel_pos, ps), INVALID)
    selections.append((sel_addr, sel_valid))
    mem_state, res = mem.resolve(mem_state, g, sel_addr, sel_valid, new_addr, active)
    stats = _add_stats(stats, res.stats)
    for l in cfg.group_layers(g):  # exact layer-wise prefetch: every move is known now
      mem_state = mem.move_layer(mem_state, l, res)
    return res

  def attend(l: int, layer: DecoderLayer, proj: Projection, res: Resolution) -> jax.Array:
    nonlocal mem_state
    mem_state = mem.write_token(mem_state, l, res, proj.entry, active)
    return _absorbed_attention(layer, proj, mem.read_pool(mem_state, l), res.slots,
                               res.valid, cfg.softmax_scale, attention, heads, tp_axis)

  x = _run_layers(model, model.embed_tokens(tokens), positions, select=select,
                  attend=attend, heads=heads)
  if not return_selection:
    return model.logits(x), mem_state, stats
  sel = {"sel_addr": jnp.stack([a for a, _ in selections]),
         "sel_valid": jnp.stack([v for _, v in selections]), "new_addr": new_addr}
  return model.logits(x), mem_state, stats, sel


# ----------------------------------------------------------------------------------
# Prefill over a dense per-request workspace
# ----------------------------------------------------------------------------------


@struct.dataclass
class PrefillWorkspace:
  """Dense KV of one request (or of a batch, with a leading [B] axis on every leaf).

  kv:         per layer [T_cap, W] entries in kv_dtype, indexed by position
  index_keys: per group [T_cap, K] indexer keys in kv_dtype
  """

  kv: tuple[jax.Array, ...]
  index_keys: tuple[jax.Array, ...]

  @property
  def capacity(self) -> int:
    """T_cap: positions the workspace holds."""
    return self.kv[0].shape[-2]


def init_workspace(cfg: ModelConfig, capacity: int, batch: int | None = None
                   ) -> PrefillWorkspace:
  """Zeroed workspace for ``capacity`` positions ([batch, ...] when ``batch`` is given)."""
  if capacity < 1:
    raise ValueError(f"workspace capacity={capacity}: must be >= 1 position")
  lead = () if batch is None else (batch,)
  return PrefillWorkspace(
      kv=tuple(jnp.zeros((*lead, capacity, cfg.entry_width), cfg.kv_dtype)
               for _ in range(cfg.num_layers)),
      index_keys=tuple(jnp.zeros((*lead, capacity, cfg.index_head_dim), cfg.kv_dtype)
                       for _ in range(cfg.num_groups)))


def prefill_chunk(model: Transformer, workspace: PrefillWorkspace, tokens: jax.Array,
                  start: jax.Array, length: jax.Array, *, attention: str = "xla"):
  """Runs one chunk of one request's prompt.

  tokens:  [C] int32 at positions start .. start+C-1; only the first ``length`` count
  start:   [] int32 (chunks of a request run in order from position 0)
  length:  [] int32, 1 <= length <= C; start + length <= workspace.capacity
  returns (entries: per layer [C, W] in kv_dtype,
           index_keys: per group [C, K] in kv_dtype,
           last_logits: [V] float32 at position start+length-1,
           workspace with the chunk's rows written)

  Each position q picks the top-k among positions <= q and attends over them with the
  same functions ``decode_step`` uses. Rows past ``length`` are computed but written
  nowhere and pick nothing. Prefill does not split heads: under tensor parallelism each
  rank computes every head of the chunk (the same entries and keys on every rank).
  """
  cfg = model.cfg
  C, T_cap = tokens.shape[0], workspace.capacity
  i = jnp.arange(C, dtype=jnp.int32)
  pos = jnp.asarray(start, jnp.int32) + i
  valid = i < length
  write_at = jnp.where(valid, pos, T_cap)  # T_cap: out of range, dropped by the scatter
  cand = (jnp.arange(T_cap, dtype=jnp.int32)[None, :] <= pos[:, None]) & valid[:, None]
  kv, index_keys = list(workspace.kv), list(workspace.index_keys)
  entries: list = [None] * cfg.num_layers
  keys_out: list = [None] * cfg.num_groups

  def select(g: int, first: Projection, indexer: Indexer):
    keys_out[g] = indexer.key(first.h)
    index_keys[g] = index_keys[g].at[write_at].set(keys_out[g], mode="drop")
    q_I, w = indexer.query(first.h, first.c_q)
    return select_topk(index_scores(q_I, w, index_keys[g]), cand, cfg.index_topk)

  def attend(l: int, layer: DecoderLayer, proj: Projection, sel) -> jax.Array:
    entries[l] = proj.entry
    kv[l] = kv[l].at[write_at].set(proj.entry, mode="drop")
    return _absorbed_attention(layer, proj, kv[l], *sel, cfg.softmax_scale, attention)

  x = _run_layers(model, model.embed_tokens(tokens), pos, select=select, attend=attend)
  last = jnp.clip(jnp.asarray(length, jnp.int32) - 1, 0, C - 1)
  last_logits = model.logits(jax.lax.dynamic_slice_in_dim(x, last, 1))[0]
  return (tuple(entries), tuple(keys_out), last_logits,
          PrefillWorkspace(kv=tuple(kv), index_keys=tuple(index_keys)))


# ----------------------------------------------------------------------------------
# Dense reference decode
# ----------------------------------------------------------------------------------


def decode_dense_reference(model: Transformer, workspace: PrefillWorkspace,
                           tokens: jax.Array, positions: jax.Array):
  """One decode step over batched dense workspaces, with non-absorbed attention over
  every position masked to the indexer's selection.

  workspace: leaves [B, T_cap, ...] (``init_workspace(cfg, T_cap, batch=B)``), holding
             positions < positions[b] of row b
  tokens, positions: [B] int32 (positions[b] < T_cap)
  returns (logits [B, V] float32, workspace with the new tokens written)
  """
  cfg = model.cfg
  B, T_cap = tokens.shape[0], workspace.capacity
  rows = jnp.arange(B)
  positions = positions.astype(jnp.int32)
  col = jnp.where(positions < T_cap, positions, T_cap)
  cand = jnp.arange(T_cap, dtype=jnp.int32)[None, :] <= positions[:, None]
  kv, index_keys = list(workspace.kv), list(workspace.index_keys)

  def select(g: int, first: Projection, indexer: Indexer) -> jax.Array:
    index_keys[g] = index_keys[g].at[rows, col].set(indexer.key(first.h), mode="drop")
    q_I, w = indexer.query(first.h, first.c_q)
    sel_pos, sel_valid = select_topk(index_scores(q_I, w, index_keys[g]), cand,
                                     cfg.index_topk)
    # The selection as a [B, T_cap] mask (invalid picks land in a dropped extra column).
    return jnp.zeros((B, T_cap + 1), bool).at[
        rows[:, None], jnp.where(sel_valid, sel_pos, T_cap)].set(True)[:, :T_cap]

  def attend(l: int, layer: DecoderLayer, proj: Projection, mask: jax.Array) -> jax.Array:
    kv[l] = kv[l].at[rows, col].set(proj.entry, mode="drop")
    return layer.attn.naive(proj.q_nope, proj.q_rope, kv[l], mask, cfg.softmax_scale)

  x = _run_layers(model, model.embed_tokens(tokens), positions, select=select,
                  attend=attend)
  return model.logits(x), PrefillWorkspace(kv=tuple(kv), index_keys=tuple(index_keys))


# ----------------------------------------------------------------------------------
# Jitted wrappers and a reference generator
# ----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("attention",))
def prefill_chunk_jit(graphdef: nnx.GraphDef, params: nnx.State, workspace: PrefillWorkspace,
                      tokens: jax.Array, start: jax.Array, length: jax.Array, *,
                      attention: str = "xla"):
  """``prefill_chunk`` on ``nnx.split(model)`` (graphdef static), jitted."""
  return prefill_chunk(nnx.merge(graphdef, params), workspace, tokens, start, length,
                       attention=attention)


@functools.partial(jax.jit, static_argnums=(0,))
def decode_dense_reference_jit(graphdef: nnx.GraphDef, params: nnx.State,
                               workspace: PrefillWorkspace, tokens: jax.Array,
                               positions: jax.Array):
  """``decode_dense_reference`` on ``nnx.split(model)`` (graphdef static), jitted."""
  return decode_dense_reference(nnx.merge(graphdef, params), workspace, tokens, positions)


def generate_reference(model: Transformer, prompt: np.ndarray, max_new_tokens: int, *,
                       chunk: int = 16, capacity: int | None = None) -> np.ndarray:
  """Greedy tokens of one request without any memory system (the exactness baseline).

  prompt: [T] int32 (T >= 1); chunk: prefill chunk length; capacity: workspace
  positions (default: T + max_new_tokens rounded up to a multiple of 64, so that
  requests of similar length share one compilation)
  returns [max_new_tokens] int32
  """
  prompt = np.asarray(prompt, np.int32)
  T = prompt.shape[0]
  if T < 1:
    raise ValueError(f"prompt length={T}: must be >= 1 token")
  need = T + max_new_tokens
  capacity = -(-need // 64) * 64 if capacity is None else capacity
  if capacity < need:
    raise ValueError(f"capacity={capacity}: must be >= prompt + max_new_tokens = {need}")
  graphdef, params = nnx.split(model)
  ws = init_workspace(model.cfg, capacity)
  for s in range(0, T, chunk):
    piece = np.zeros(chunk, np.int32)
    n = min(chunk, T - s)
    piece[:n] = prompt[s:s + n]
    _, _, logits, ws = prefill_chunk_jit(graphdef, params, ws, jnp.asarray(piece),
                                         jnp.int32(s), jnp.int32(n))
  out = []
  ws = jax.tree.map(lambda a: a[None], ws)  # a batch of one request
  for step in range(max_new_tokens):
    tok = jnp.argmax(logits).astype(jnp.int32)
    out.append(int(tok))
    if step + 1 < max_new_tokens:
      logits, ws = decode_dense_reference_jit(graphdef, params, ws, tok[None],
                                              jnp.full((1,), T + step, jnp.int32))
      logits = logits[0]
  return np.asarray(out, np.int32)
