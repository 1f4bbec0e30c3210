"""The decoder and its three ways of running.

* ``decode_step``: one token per batch row, KV through a memory system (``core.types.DecodeMemory``) (the engine's
  decode, inside ``shard_map``), sparse attention in absorbed form over resolved slots.
* ``prefill_chunk``: one chunk of one request's prompt over a dense per-request
  ``PrefillWorkspace``; returns the entries and indexer keys the engine hands to the
  memory system.
* ``decode_dense_reference``: one token per row over batched workspaces, dense
  non-absorbed attention masked to the indexer's selection (a check for the other two).

All three run the same layer stack (``_run_layers``) and indexer scores; they differ only
in where KV lives and how attention reads it. Decode selects with ``select_topk``,
prefill with ``prefix_topk`` (each prompt position its own top-k over its prefix, in
row blocks, by radix select: the same picks in position order), and prefill attends
with the decode attention functions, the chunk's positions as their rows (densely while
the prompt is no longer than top-k), so decoding token t after prefilling positions < t
gives the logits that prefilling t would (up to float32 rounding).

Layer l belongs to index-sharing group ``l // index_share``; the group's first layer
computes the selection that every layer of the group attends over. Groups of the same
shape are stacked (``Segment``: parameters with a leading group axis) and run as one
``lax.scan``, so compile time and program size do not grow with depth; the KV a
callback keeps (a memory system's state, a workspace) is stacked over layers and groups
too and travels in the scan's carry.

Tensor parallelism (``decode_step(..., tp_axis='tp')`` inside ``shard_map``): each rank
of the axis computes the queries, absorbed attention and output projection of its
``H / tp`` heads over the same selected entries, and the ranks' shares of the
attention output are summed (``tp_sum``). Parameters stay whole on every rank; the
indexer, norms and feed-forward layers run replicated, so every rank holds the same
hidden state, selection and entries.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from ula_jax.kernels.sparse_attention import sparse_mla_attention
from ula_jax.core import digest
from ula_jax.core.addressing import addrs_of_positions
from ula_jax.core.types import INVALID, DecodeMemory, Resolution
from ula_jax.models.config import ModelConfig
from ula_jax.kernels.indexer import SCRATCH_BYTES, index_scores, prefix_topk, select_topk
from ula_jax.kernels.stacked_matmul import check_impl
from ula_jax.kernels.sparse_attention.prefill import (dense_causal_attention,
                                                      sparse_attention_rows)
from ula_jax.models.layers import (F32, MLP, HeadRange, Indexer, InPlaceWeight, MLAttention,
                                   MoE, RMSNorm, normal_param)
from ula_jax.models.mtp import MTPBlock


class Projection(NamedTuple):
  """What a layer computes before attention (``DecoderLayer.pre_attention``)."""

  h: jax.Array  # [N, D] normed layer input (the group's indexer reads it too)
  c_q: jax.Array  # [N, Q] q latent
  q_nope: jax.Array  # [N, H, dn] (H: this rank's heads under tensor parallelism)
  q_rope: jax.Array  # [N, H, dr], rotated
  entry: jax.Array  # [N, W] concat(c, k_rope) as stored (model.kv_layout: W values or bytes)


class DecoderLayer(nnx.Module):
  """RMSNorm -> MLA -> residual -> RMSNorm -> MLP (dense layers) or MoE -> residual."""

  def __init__(self, cfg: ModelConfig, dense: bool, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
    self.attn = MLAttention(cfg, rngs=rngs)
    self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
    self.ffn = (MLP(cfg.hidden_size, cfg.intermediate_size, cfg.dtype, rngs=rngs)
                if dense else MoE(cfg, rngs=rngs))

  def pre_attention(self, x_nd: jax.Array, pos_n: jax.Array,
                    heads: HeadRange | None = None) -> Projection:
    h_nd = self.attn_norm(x_nd)
    return Projection(h_nd, *self.attn.project(h_nd, pos_n, heads))

  def post_attention(self, x_nd: jax.Array, attn_nd: jax.Array) -> jax.Array:
    x_nd = x_nd + attn_nd
    return x_nd + self.ffn(self.ffn_norm(x_nd))


class IndexerInput(NamedTuple):
  """What a group's indexer reads of the group's first layer."""

  h: jax.Array  # [N, D] the first layer's normed input
  c_q: jax.Array  # [N, Q] its q latent


class GroupBlock(nnx.Module):
  """One index-sharing layer group: its decoder layers as runs of same-shaped layers
  with stacked parameters (``Segment.runs``), and its indexer (which reads the first
  layer's normed input and q latent)."""

  def __init__(self, cfg: ModelConfig, dense: tuple[bool, ...], *, rngs: nnx.Rngs):
    self.runs = nnx.List([_stacked(lambda d=d: DecoderLayer(cfg, d, rngs=rngs), n)
                          for d, n in _runs(dense)])
    self.indexer = Indexer(cfg, rngs=rngs)

  def first_layer(self) -> DecoderLayer:
    """The group's first layer, with its own (unstacked) parameters."""
    graphdef, params = nnx.split(self.runs[0])
    return nnx.merge(graphdef, jax.tree.map(lambda x: x[0], params))

  def indexer_input(self, x_nd: jax.Array, first: DecoderLayer | None = None
                    ) -> IndexerInput:
    """The first layer's normed input and q latent for hidden state ``x_nd`` [N, D]
    (``first``: that layer, when the caller has it)."""
    first = self.first_layer() if first is None else first
    h_nd = first.attn_norm(x_nd)
    return IndexerInput(h_nd, first.attn.query_latent(h_nd))

  def layer(self, i: int) -> DecoderLayer:
    """The group's ``i``-th layer with its own (unstacked) parameters."""
    for stack in self.runs:
      graphdef, params = nnx.split(stack)
      n = jax.tree.leaves(params)[0].shape[0]
      if i < n:
        return nnx.merge(graphdef, jax.tree.map(lambda x: x[i], params))
      i -= n
    raise IndexError(f"layer {i}: past the group's last layer")


def _runs(dense: tuple[bool, ...]) -> list[tuple[bool, int]]:
  """Consecutive equal flags as (flag, count) pairs."""
  out: list[tuple[bool, int]] = []
  for d in dense:
    if out and out[-1][0] == d:
      out[-1] = (d, out[-1][1] + 1)
    else:
      out.append((d, 1))
  return out


@functools.partial(jax.jit, static_argnums=1)
def _stack_first(first: Any, n: int) -> Any:
  """[n, ...] arrays holding ``first``'s leaves at index 0 (the rest zeros)."""
  return jax.tree.map(lambda x: jnp.zeros((n, *x.shape), x.dtype).at[0].set(x), first)


@functools.partial(jax.jit, donate_argnums=0)
def _stack_put(stacked: Any, piece: Any, i: jax.Array) -> Any:
  """``stacked`` with ``piece``'s leaves written at index ``i``, in place."""
  return jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, i, 0),
                      stacked, piece)


def _stacked(make: Callable[[], nnx.Module], n: int) -> nnx.Module:
  """``make()`` called ``n`` times, as one module whose every parameter has a leading
  ``[n]`` axis.

  Each module's parameters are written into the stacked arrays as soon as they are
  drawn, and the next module is drawn only after that write has run: at most the stacked
  arrays and one module's parameters are held at once. (Stacking ``n`` finished modules
  holds every piece beside the result: GLM-5's 72 stacked query projections need 4.5 GiB
  of pieces beside their 4.5 GiB stack, on top of the pools made before the parameters.)
  The values are those of drawing all ``n`` and stacking them."""
  first = make()
  stacked = _stack_first(nnx.state(first), n)
  concrete = not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(stacked))
  for i in range(1, n):
    stacked = _stack_put(stacked, nnx.state(make()), jnp.int32(i))
    if concrete:  # the piece is freed before the next one is drawn
      stacked = jax.block_until_ready(stacked)
  nnx.update(first, stacked)
  return first


@dataclasses.dataclass(frozen=True)
class Segment:
  """Consecutive layer groups of the same shape (layer count, dense or MoE per layer):
  their parameters are stacked and the layer stack runs them as one ``lax.scan``; within
  a group, each run of same-shaped layers is one inner ``lax.scan``."""

  first_group: int
  num_groups: int
  dense: tuple[bool, ...]  # per layer of each group: a dense MLP (else MoE)

  @property
  def runs(self) -> list[tuple[bool, int]]:
    """The group's layers as runs of equal shape: (dense, count)."""
    return _runs(self.dense)


def group_segments(cfg: ModelConfig) -> tuple[Segment, ...]:
  """The model's groups as segments: a mixed first group (dense and MoE layers) and a
  short last group are segments of their own, the regular groups between one segment,
  so the number of segments does not grow with depth (GLM-5: 3)."""
  out: list[Segment] = []
  for g in range(cfg.num_groups):
    dense = tuple(l < cfg.num_dense_layers for l in cfg.group_layers(g))
    if out and out[-1].dense == dense:
      out[-1] = dataclasses.replace(out[-1], num_groups=out[-1].num_groups + 1)
    else:
      out.append(Segment(g, 1, dense))
  return tuple(out)


def _stacked_blocks(cfg: ModelConfig, seg: Segment, rngs: nnx.Rngs) -> GroupBlock:
  """A ``GroupBlock`` whose every parameter has a leading ``[seg.num_groups]`` axis."""
  return _stacked(lambda: GroupBlock(cfg, seg.dense, rngs=rngs), seg.num_groups)


class Transformer(nnx.Module):
  """Embedding, layer groups (stacked per ``Segment``), final norm, LM head, and the MTP
  block that drafts tokens for speculative decoding (``mtp.MTPBlock``; drawn last, so
  the other parameters do not depend on it).

  ``rngs`` defaults to ``nnx.Rngs(cfg.param_seed)``: the same config gives the same
  parameters.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None):
    rngs = nnx.Rngs(cfg.param_seed) if rngs is None else rngs
    self.cfg = cfg
    self.embed = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), 1, cfg.dtype, std=1.0)
    self.segments = nnx.List([_stacked_blocks(cfg, s, rngs) for s in group_segments(cfg)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype)
    self.lm_head = normal_param(rngs, (cfg.hidden_size, cfg.vocab_size), cfg.hidden_size,
                          cfg.dtype)
    self.mtp = MTPBlock(cfg, rngs=rngs)
    self.projections = "xla"  # kernels.projections (use_projections)
    self.projections_interpret: bool | None = None

  def use_projections(self, impl: str, interpret: bool | None = None) -> None:
    """``kernels.projections``: with 'pallas' the layer stack's products with per-layer
    weights (``IN_PLACE``: MLA's projections, the experts and MLPs, the indexer's) read
    each layer's weights in place from the stacked arrays (``kernels.stacked_matmul``)
    where the rows are few enough (a decode step); under tensor parallelism the per-head
    products (MLA's up-projections and output projection, on a rank's heads) slice
    theirs, the rest read in place; 'xla' slices them all out (XLA copies each slice).
    A static setting: it is part of the model's graph definition."""
    check_impl(impl)
    self.projections = impl
    self.projections_interpret = interpret

  def block(self, group: int) -> GroupBlock:
    """Group ``group``'s layers and indexer, with its own (unstacked) parameters."""
    for seg, stack in zip(group_segments(self.cfg), self.segments):
      if seg.first_group <= group < seg.first_group + seg.num_groups:
        graphdef, params = nnx.split(stack)
        return nnx.merge(graphdef, jax.tree.map(lambda x: x[group - seg.first_group], params))
    raise IndexError(f"group={group}: the model has {self.cfg.num_groups} layer groups")

  def layer(self, layer: int) -> DecoderLayer:
    """Decoder layer ``layer`` with its own parameters."""
    g = layer // self.cfg.index_share
    return self.block(g).layer(layer - g * self.cfg.index_share)

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """[N] int32 -> [N, D]."""
    return self.embed[...][tokens]

  def logits(self, x_nd: jax.Array) -> jax.Array:
    """[N, D] final hidden -> [N, V] float32."""
    return jnp.einsum("nd,dv->nv", self.final_norm(x_nd), self.lm_head[...],
                      preferred_element_type=F32)


def param_bytes(cfg: ModelConfig) -> int:
  """Bytes of the parameters ``Transformer(cfg)`` holds, from their shapes alone (nothing
  is allocated): on every device of a run, beside the memory system's pools."""
  _, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(params))


Select = Callable[[jax.Array, tuple[jax.Array, int], IndexerInput, Indexer, Any],
                  tuple[Any, Any]]
Attend = Callable[[jax.Array, DecoderLayer, Projection, Any, Any], tuple[jax.Array, Any]]


def _run_layers(model: Transformer, x_nd: jax.Array, pos_n: jax.Array, carry: Any, *,
                select: Select, attend: Attend,
                heads: HeadRange | None = None) -> tuple[jax.Array, Any]:
  """The layer stack, shared by every way of running the model: one ``lax.scan`` over
  the groups of each ``Segment`` (a handful per model) and, within a group, one inner
  ``lax.scan`` per run of same-shaped layers (GLM-5: four copies of a layer's code in
  the whole program), so the program does not grow with depth.

  Per group g: ``sel, carry = select(g, (first layer, layer count), indexer input,
  indexer, carry)`` with the first layer's normed input and q latent
  (``GroupBlock.indexer_input``; the first layer computes them again with its
  queries); then per layer l of the group, ``out, carry = attend(l, layer, projection,
  sel, carry)`` with the attention output [N, D]. ``g``, ``l`` and the first layer are
  traced int32 scalars (the count a Python int). The callbacks own the KV storage and
  thread it through ``carry``.
  heads: the heads whose queries the projections hold (None = all).
  returns (final hidden [N, D], carry)
  """
  share = model.cfg.index_share
  in_place = model.projections != "xla"

  def place(module, weights, row):
    # weights: {path: (stack, shape, transposed)}, read in place at ``row`` of each.
    for path, (stack, shape, transposed) in weights.items():
      owner = functools.reduce(getattr, path[:-1], module)
      getattr(owner, path[-1]).set_value(InPlaceWeight(
          stack, row, shape, transposed, model.projections, model.projections_interpret))
    return module

  def run_body(sel, graphdef, weights, first):
    # weights: {path: (stack [G * n, B, K, N], shape, transposed)} read in place; layer
    # l's row of each is first + l (first: the run's row of layer 0).
    def body(xc, xs):
      x, c = xc
      p, l = xs
      layer = place(nnx.merge(graphdef, p), weights, first + l)
      out, c = attend(l, layer, layer.pre_attention(x, pos_n, heads), sel, c)
      return (layer.post_attention(x, out), c), None
    return body

  for seg, stack in zip(group_segments(model.cfg), model.segments):
    graphdef, params = nnx.split(stack)
    params, stacks = _left_in_place(params) if in_place else (params, {})

    def body(xc, xs, graphdef=graphdef, seg=seg, stacks=stacks):
      x, c = xc
      p, g = xs
      block = nnx.merge(graphdef, p)
      l0 = g * share
      place(block.indexer, stacks.get("indexer", {}), g - seg.first_group)
      first_layer = place(block.first_layer(), stacks.get(0, {}),
                          (g - seg.first_group) * seg.runs[0][1])
      sel, c = select(g, (l0, len(seg.dense)), block.indexer_input(x, first_layer),
                      block.indexer, c)
      start = 0
      for j, ((_, n), run) in enumerate(zip(seg.runs, block.runs)):
        run_graphdef, run_params = nnx.split(run)
        layers = l0 + jnp.arange(start, start + n, dtype=jnp.int32)
        # Row of layer l in a run's stack [G * n, ...]: (g - first group) * n + (l - l0 - start).
        first = (g - seg.first_group) * n - l0 - start
        (x, c), _ = jax.lax.scan(run_body(sel, run_graphdef, stacks.get(j, {}), first),
                                 (x, c), (run_params, layers))
        start += n
      return (x, c), None

    groups = jnp.arange(seg.first_group, seg.first_group + seg.num_groups, dtype=jnp.int32)
    (x_nd, carry), _ = jax.lax.scan(body, (x_nd, carry), (params, groups))
  return x_nd, carry


# The products that read their weights in place, by the parameter's path in a layer (or
# in a group's indexer, under "indexer"): {rank of the layer's weight: (batch axes,
# contracted axes, transposed)}. The feed-forward weights by rank: a MoE layer's experts
# [E | D | F], a dense layer's MLP [D | F].
IN_PLACE = {
    ("attn", "w_dq"): {2: (0, 1, False)},    # [D | Q]
    ("attn", "w_dkv"): {2: (0, 1, False)},   # [D | C]
    ("attn", "w_kr"): {2: (0, 1, False)},    # [D | R]
    ("attn", "w_uq"): {3: (0, 1, False)},    # [Q | H, E]
    ("attn", "w_o"): {3: (0, 2, False)},     # [H, V | D]
    ("attn", "w_uv"): {3: (1, 1, False)},    # [H | C | V]
    ("attn", "w_uk"): {3: (1, 1, True)},     # [H | C | dn], contracted over dn
    ("ffn", "w_gate"): {3: (1, 1, False), 2: (0, 1, False)},
    ("ffn", "w_up"): {3: (1, 1, False), 2: (0, 1, False)},
    ("ffn", "w_down"): {3: (1, 1, False), 2: (0, 1, False)},
    ("ffn", "shared", "w_gate"): {2: (0, 1, False)},
    ("ffn", "shared", "w_up"): {2: (0, 1, False)},
    ("ffn", "shared", "w_down"): {2: (0, 1, False)},
    ("indexer", "w_q"): {3: (0, 1, False)},  # [Q | I, K]
    ("indexer", "w_k"): {2: (0, 1, False)},  # [D | K]
    ("indexer", "w_w"): {2: (0, 1, False)},  # [D | I]
}


def _left_in_place(params: nnx.State) -> tuple[nnx.State, dict]:
  """A segment's stacked parameters with the ``IN_PLACE`` weights taken out of the scans.

  returns (params with each such weight replaced by a zero-size placeholder ([G, n, 0]
  for a layer's, [G, 0] for an indexer's), so that no scan slices or copies it; {run j
  or "indexer": {path: (stack [G * n, B, K, N] or [G, B, K, N], layer shape,
  transposed)}}: the whole arrays, layer axes merged, batch, contracted and output axes
  each flattened (output before contracted when transposed), as ``InPlaceWeight`` reads
  them).
  """
  stacks: dict = {}

  def take(path, leaf):
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    if keys[0] == "runs":
      owner, keys, lead = keys[1], keys[2:], 2  # [G, n] + a layer's shape
    else:
      owner, lead = keys[0], 1  # [G] + the indexer's shape
    # The parameter's path, with or without the state's key for its value ("value").
    name = next((tuple(k) for k in (keys, keys[:-1]) if tuple(k) in IN_PLACE), None)
    spec = IN_PLACE[name].get(leaf.ndim - lead) if name else None
    if spec is None:
      return leaf
    shape = leaf.shape[lead:]
    nb, nk, transposed = spec
    batch = int(np.prod(shape[:nb]))
    first = int(np.prod(shape[nb:nb + nk]))
    stacks.setdefault(owner, {})[name[1:] if owner == "indexer" else name] = (
        leaf.reshape(-1, batch, first, int(np.prod(shape)) // (batch * first)),
        tuple(shape), transposed)
    return jnp.zeros(leaf.shape[:lead] + (0,), leaf.dtype)

  return jax.tree_util.tree_map_with_path(take, params), stacks


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
                        tp_axis: str | None = None,
                        interpret: bool | None = None) -> jax.Array:
  """Sparse absorbed-form MLA over ``pool[slots]``: [N, D].

  With ``heads`` and ``tp_axis``, ``proj`` holds this rank's heads; their share of the
  output is accumulated in float32 and summed over the ``tp_axis`` ranks. interpret: the
  Pallas kernel's interpret mode (``kernels.interpret``; None: off on a GPU only).
  """
  o_lat = sparse_mla_attention(layer.attn.absorb(proj.q_nope, heads), proj.q_rope, pool,
                               slots, valid, scale=scale, impl=impl,
                               kv_layout=layer.attn.layout.kind, interpret=interpret)
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


def fence(x: Any) -> Any:
  """``x`` behind an optimization barrier: where the model hands a value to a memory
  system (an entry, an indexer key or query) or takes one back (an attention output),
  no fusion reaches across, so XLA compiles the model's side the same way whatever the
  memory system does around it (its rounding and summation order then do not depend on
  which system's program it is in). Costs nothing but the fusions it prevents."""
  return jax.lax.optimization_barrier(x)


def _attend_through(mem: DecodeMemory, active: jax.Array, scale: float, attention: str,
                    heads: HeadRange | None, tp_axis: str | None,
                    interpret: bool | None = None):
  """The ``attend`` of a step whose KV lives in ``mem``: write each row's new entry
  (``active`` [N] rows), then attend over ``read_pool`` at the resolved slots."""
  def attend(l, layer: DecoderLayer, proj: Projection, res: Resolution, c):
    proj = fence(proj)
    st = mem.write_token(c["mem"], l, res, proj.entry, active)
    pool, base = mem.read_pool(st, l)
    rows = jnp.where(res.valid, base + res.slots, INVALID)
    out = _absorbed_attention(layer, proj, pool, rows, res.valid, scale, attention, heads,
                              tp_axis, interpret)
    return fence(out), {**c, "mem": st}
  return attend


def _add_stats(total: dict, new: dict) -> dict:
  out = dict(total)
  for k, v in new.items():
    out[k] = out.get(k, jnp.int32(0)) + jnp.asarray(v, jnp.int32)
  return out


def decode_step(model: Transformer, mem: DecodeMemory, mem_state, tokens: jax.Array,
                positions: jax.Array, page_table: jax.Array, active: jax.Array, *,
                attention: str = "xla", tp_axis: str | None = None,
                return_selection: bool = False, return_digests: bool = False,
                interpret: bool | None = None):
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
  interpret:  the Pallas attention's interpret mode (``kernels.interpret``; None: off
              on a GPU only)
  returns (logits [B, V] float32, mem_state, stats: dict[str, int32 scalar] summed
           over layer groups); with ``tp_axis`` the same on every rank of the axis.
           With ``return_selection``, a fourth value: {"sel_addr": [G, B, k] int32,
           "sel_valid": [G, B, k] bool, "new_addr": [B] int32}; with ``return_digests``
           the fourth value (also) holds the ``core.digest.STEP_DIGESTS`` as
           "digest_<name>", uint32: "digest_selection" [G, B] (the selected positions),
           "digest_new" [L, B] (the new token's entry as the layer computed it),
           "digest_entries" [L, B] (the stored entries attention read, the new token's
           own left out) and "digest_output" [L, B] (the attention output)

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
  B, G, k = tokens.shape[0], cfg.num_groups, cfg.index_topk
  positions = positions.astype(jnp.int32)
  new_addr = addrs_of_positions(page_table, positions[:, None], ps)[:, 0]
  new_addr = jnp.where(active, new_addr, INVALID)
  # The carry sums the resolves' counters over groups: their keys are declared up front.
  stat_keys = tuple(mem.stat_keys())
  carry = {"mem": mem_state, "stats": {key: jnp.int32(0) for key in stat_keys}}
  if return_selection:
    carry["sel_addr"] = jnp.full((G, B, k), INVALID, jnp.int32)
    carry["sel_valid"] = jnp.zeros((G, B, k), bool)
  if return_digests:
    for name in digest.STEP_DIGESTS:
      width = G if name == "selection" else cfg.num_layers
      carry[f"digest_{name}"] = jnp.zeros((width, B), jnp.uint32)

  def select(g, layers, first: IndexerInput, indexer: Indexer, c):
    key, (q_I, w) = fence((cfg.key_layout.encode(indexer.key(first.h, positions)),
                           indexer.query(first.h, first.c_q, positions)))
    st = mem.write_index_keys(c["mem"], g, new_addr, key)
    l0, n = layers
    sel_pos, sel_valid = mem.select(st, g, q_I, w, page_table, positions, active)
    sel_addr = jnp.where(sel_valid, addrs_of_positions(page_table, sel_pos, ps), INVALID)
    st, res = mem.resolve(st, g, sel_addr, sel_valid, new_addr, active)
    if set(res.stats) != set(stat_keys):
      raise ValueError(f"{type(mem).__name__}.resolve returned stats {sorted(res.stats)}; "
                       f"its stat_keys() declares {sorted(stat_keys)}")
    # Every layer's moves are known now.
    st = mem.move_group(st, l0, n, res)
    c = {**c, "mem": st, "stats": _add_stats(c["stats"], res.stats)}
    if return_selection:
      c["sel_addr"] = c["sel_addr"].at[g].set(sel_addr)
      c["sel_valid"] = c["sel_valid"].at[g].set(sel_valid)
    if return_digests:
      c["digest_selection"] = c["digest_selection"].at[g].set(
          digest.positions_digest(sel_pos, sel_valid))
    return res, c

  attend = _attend_through(mem, active, cfg.softmax_scale, attention, heads, tp_axis,
                           interpret)
  if return_digests:
    attend = _digesting(attend, mem)

  x, carry = _run_layers(model, model.embed_tokens(tokens), positions, carry, select=select,
                         attend=attend, heads=heads)
  if not (return_selection or return_digests):
    return model.logits(x), carry["mem"], carry["stats"]
  sel = {}
  if return_selection:
    sel = {"sel_addr": carry["sel_addr"], "sel_valid": carry["sel_valid"],
           "new_addr": new_addr}
  if return_digests:
    sel.update({f"digest_{n}": carry[f"digest_{n}"] for n in digest.STEP_DIGESTS})
  return model.logits(x), carry["mem"], carry["stats"], sel


def _digesting(attend: Attend, mem: DecodeMemory) -> Attend:
  """``attend`` that also records, per layer, digests of the new token's entry as the
  layer computed it, of the stored entries it read (the pool's rows at the resolved
  slots, the new token's own slot left out: its bytes are the model's, not the memory
  system's) and of its output."""
  def wrapped(l, layer, proj, res: Resolution, c):
    out, c = attend(l, layer, proj, res, c)
    pool, base = mem.read_pool(c["mem"], l)
    rows = jnp.where(res.valid, base + res.slots, 0)
    read = pool.at[rows].get(mode="promise_in_bounds")  # [B, k, W]
    stored = res.valid & (res.slots != res.new_slot[:, None])
    c = {**c,
         "digest_new": c["digest_new"].at[l].set(digest.values_digest(proj.entry)),
         "digest_entries": c["digest_entries"].at[l].set(digest.rows_digest(read, stored)),
         "digest_output": c["digest_output"].at[l].set(digest.values_digest(out))}
    return out, c
  return wrapped


def union_rows(sel_addr: jax.Array, sel_valid: jax.Array) -> tuple[jax.Array, jax.Array,
                                                                    jax.Array]:
  """Per request, the union of its rows' selections, each address once.

  sel_addr/sel_valid: [B, U] int32 / bool (a request's rows' selections side by side)
  returns (union [B, U] int32: ``sel_addr`` with every repeat of an address made INVALID,
           union_valid [B, U] bool, rep [B, U] int32: the column of each element's first
           occurrence, where the union holds it)
  """
  B, U = sel_addr.shape
  big = jnp.iinfo(jnp.int32).max
  key = jnp.where(sel_valid, sel_addr, big)
  order = jnp.argsort(key, axis=1, stable=True)  # equal addresses: first column first
  skey = jnp.take_along_axis(key, order, axis=1)
  head = jnp.concatenate([jnp.ones((B, 1), bool), skey[:, 1:] != skey[:, :-1]], axis=1)
  start = jax.lax.cummax(jnp.where(head, jnp.arange(U), 0), axis=1)
  rows = jnp.arange(B)[:, None]
  rep = jnp.zeros((B, U), jnp.int32).at[rows, order].set(  # a permutation: unique
      jnp.take_along_axis(order, start, axis=1).astype(jnp.int32), unique_indices=True)
  union_valid = sel_valid & (rep == jnp.arange(U)[None, :])
  return jnp.where(union_valid, sel_addr, INVALID), union_valid, rep


def verify_step(model: Transformer, mem: DecodeMemory, mem_state, tokens: jax.Array,
                positions: jax.Array, page_table: jax.Array, active: jax.Array, *,
                attention: str = "xla", tp_axis: str | None = None,
                interpret: bool | None = None):
  """One verify step of speculative decoding: ``R`` query rows per request, KV in ``mem``.

  tokens:     [B, R] int32 row r's token, at position ``positions[b] + r`` (row 0: the
              last accepted token; rows 1..: drafts)
  positions:  [B] int32 row 0's position
  page_table: [B, P] int32 logical pages of each request
  active:     [B, R] bool rows to verify (a request's first rows; none for an idle one)
  interpret:  the Pallas attention's interpret mode, as ``decode_step``'s
  returns (logits [B, R, V] float32, hidden [B, R, D] the final hidden states before the
           final norm (what the MTP block drafts from), mem_state, stats summed over
           layer groups, as ``decode_step``'s)

  Each row computes what ``decode_step`` computes for its token at its position: the
  indexer scores its candidates (positions <= its own, the earlier rows' new keys
  included: they are written first), takes its own top-k, and attends over those
  entries (the earlier rows' new entries of the layer included: they are written
  before attention reads). Per layer group the memory system resolves, per request, the
  union of its rows' selections (``union_rows``; each entry once) with the rows' new
  tokens (``MemorySystem.resolve_rows``), so every entry any row selected is on the
  device for the step; each row then reads its own entries at their resolved slots.
  The rows run as ``B * R`` rows of one batch through the layer stack, whose arithmetic
  is per row. Rows past a rejected draft compute (and store) garbage that the request's
  next step overwrites.
  """
  cfg = model.cfg
  heads = None if tp_axis is None else tp_heads(cfg.num_heads, tp_axis)
  ps = mem.page_size
  B, R = tokens.shape
  N, k = B * R, cfg.index_topk
  pos_br = positions.astype(jnp.int32)[:, None] + jnp.arange(R, dtype=jnp.int32)[None, :]
  new_br = jnp.where(active, addrs_of_positions(page_table, pos_br, ps), INVALID)
  pos_n, active_n, new_n = pos_br.reshape(-1), active.reshape(-1), new_br.reshape(-1)
  table_n = jnp.repeat(page_table, R, axis=0)  # [N, P] each row its request's pages
  stat_keys = tuple(mem.stat_keys())
  carry = {"mem": mem_state, "stats": {key: jnp.int32(0) for key in stat_keys}}

  def select(g, layers, first: IndexerInput, indexer: Indexer, c):
    key, (q_I, w) = fence((cfg.key_layout.encode(indexer.key(first.h, pos_n)),
                           indexer.query(first.h, first.c_q, pos_n)))
    st = mem.write_index_keys(c["mem"], g, new_n, key)
    l0, n = layers
    sel_pos, sel_valid = mem.select(st, g, q_I, w, table_n, pos_n, active_n)  # [N, k]
    sel_addr = jnp.where(sel_valid, addrs_of_positions(table_n, sel_pos, ps), INVALID)
    union, union_valid, rep = union_rows(sel_addr.reshape(B, R * k),
                                         sel_valid.reshape(B, R * k))
    st, res = mem.resolve_rows(st, g, union, union_valid, new_br, active)
    if set(res.stats) != set(stat_keys):
      raise ValueError(f"{type(mem).__name__}.resolve_rows returned stats "
                       f"{sorted(res.stats)}; its stat_keys() declares {sorted(stat_keys)}")
    st = mem.move_group(st, l0, n, res)
    # Each row's entries, in its own selection order, at the union's slots.
    slots = jnp.take_along_axis(res.slots, rep, axis=1).reshape(N, k)
    res = res.replace(slots=jnp.where(sel_valid, slots, INVALID), valid=sel_valid)
    return res, {**c, "mem": st, "stats": _add_stats(c["stats"], res.stats)}

  attend = _attend_through(mem, active_n, cfg.softmax_scale, attention, heads, tp_axis,
                           interpret)

  x, carry = _run_layers(model, model.embed_tokens(tokens.reshape(-1)), pos_n, carry,
                         select=select, attend=attend, heads=heads)
  logits = model.logits(x)
  return (logits.reshape(B, R, -1), x.reshape(B, R, -1), carry["mem"], carry["stats"])


# ----------------------------------------------------------------------------------
# Prefill over a dense per-request workspace
# ----------------------------------------------------------------------------------


@struct.dataclass
class PrefillWorkspace:
  """Dense KV of one request (or of a batch, with a leading [B] axis on every leaf).

  kv:         [L * T_cap, W] stored entry rows (``cfg.entry_layout``: kv_dtype values or
              fp8 bytes), layer l's position t at row l * T_cap + t
  index_keys: [G, T_cap, Kr] stored indexer keys (``cfg.key_layout``: K kv_dtype values or
              K + 4 fp8 bytes), by position
  """

  kv: jax.Array
  index_keys: jax.Array

  @property
  def capacity(self) -> int:
    """T_cap: positions the workspace holds."""
    return self.index_keys.shape[-2]


def init_workspace(cfg: ModelConfig, capacity: int, batch: int | None = None
                   ) -> PrefillWorkspace:
  """Zeroed workspace for ``capacity`` positions ([batch, ...] when ``batch`` is given)."""
  if capacity < 1:
    raise ValueError(f"workspace capacity={capacity}: must be >= 1 position")
  lead = () if batch is None else (batch,)
  return PrefillWorkspace(
      kv=jnp.zeros((*lead, cfg.num_layers * capacity, cfg.entry_layout.row_width),
                   cfg.entry_layout.row_dtype),
      index_keys=jnp.zeros((*lead, cfg.num_groups, capacity, cfg.key_layout.row_width),
                           cfg.key_layout.row_dtype))


def prefill_chunk(model: Transformer, workspace: PrefillWorkspace, tokens: jax.Array,
                  start: jax.Array, length: jax.Array, *, attention: str = "xla",
                  indexer: str = "xla", scratch_bytes: int = SCRATCH_BYTES,
                  interpret: bool | None = None):
  """Runs one chunk of one request's prompt.

  tokens:  [C] int32 at positions start .. start+C-1; only the first ``length`` count
  start:   [] int32 (chunks of a request run in order from position 0)
  length:  [] int32, 1 <= length <= C; start + length <= workspace.capacity
  attention: sparse attention implementation (``kernels.attention``)
  indexer: indexer scores implementation (``kernels.indexer``: 'xla' | 'pallas')
  scratch_bytes: what a layer group's selection, and a layer's attention with
           ``attention='xla'``, may allocate at once (``engine.prefill_scratch``): the
           chunk's rows run in blocks that fit
  interpret: Pallas interpret mode (None: everywhere but on GPU)
  returns (entries: [L, C, W] stored rows (``cfg.entry_layout``), layer-major,
           index_keys: [G, C, Kr] stored keys (``cfg.key_layout``),
           last_logits: [V] float32 at position start+length-1,
           workspace with the chunk's rows written)

  Sparse prefill as in DeepSeek-V3.2: each position q picks its own top-k among
  positions <= q (``kernels.indexer.prefix_topk``: indexer scores in row blocks, an
  exact radix top-k; picks in ascending position order) and attends over them with the
  decode attention kernels, the chunk's positions as their rows
  (``sparse_attention.prefill.sparse_attention_rows``). While the chunk's last position
  has at most top-k predecessors (start + length <= top-k), every earlier position is
  picked and attention is a dense causal one over the first top-k rows
  (``dense_causal_attention``): what the sparse form gives, up to rounding, without
  scoring or gathering. Rows past ``length`` are computed but written nowhere and pick
  nothing. Prefill does not split heads: under tensor parallelism each rank computes
  every head of the chunk (the same entries and keys on every rank).
  """
  cfg = model.cfg
  C, T_cap = tokens.shape[0], workspace.capacity
  L, G, k = cfg.num_layers, cfg.num_groups, cfg.index_topk
  i = jnp.arange(C, dtype=jnp.int32)
  pos = jnp.asarray(start, jnp.int32) + i
  valid = i < length
  limit = jnp.where(valid, pos + 1, 0)  # row i's candidates: positions < limit[i]
  dense = jnp.asarray(start, jnp.int32) + jnp.asarray(length, jnp.int32) <= k
  window = min(k, T_cap)
  carry = {"kv": workspace.kv, "keys": workspace.index_keys,
           "entries": jnp.zeros((L, C, cfg.entry_layout.row_width), cfg.entry_layout.row_dtype),
           "keys_out": jnp.zeros((G, C, cfg.key_layout.row_width), cfg.key_layout.row_dtype)}
  # The chunk's rows go to distinct positions (rows past ``length`` are dropped), so the
  # writes say unique_indices: on a GPU with deterministic ops a scatter whose indices
  # may collide becomes a loop over its rows.

  def select(g, layers, first: IndexerInput, module: Indexer, c):
    del layers
    key = cfg.key_layout.encode(module.key(first.h, pos))
    keys = c["keys"].at[g, jnp.where(valid, pos, T_cap)].set(key, mode="drop",
                                                             unique_indices=True)
    q_I, w = module.query(first.h, first.c_q, pos)
    sel = prefix_topk(q_I, w, cfg.key_layout.decode(keys[g]), limit, k, impl=indexer,
                      scratch_bytes=scratch_bytes, interpret=interpret)
    return sel, {**c, "keys": keys, "keys_out": c["keys_out"].at[g].set(key)}

  def attend(l, layer: DecoderLayer, proj: Projection, sel, c):
    sel_pos, sel_valid = sel
    kv = c["kv"].at[jnp.where(valid, l * T_cap + pos, L * T_cap)].set(
        proj.entry, mode="drop", unique_indices=True)
    q_lat = layer.attn.absorb(proj.q_nope)
    kind = layer.attn.layout.kind

    def sparse():
      rows = jnp.where(sel_valid, l * T_cap + sel_pos, INVALID)
      return sparse_attention_rows(q_lat, proj.q_rope, kv, rows, sel_valid,
                                   scale=cfg.softmax_scale, impl=attention,
                                   scratch_bytes=scratch_bytes, kv_layout=kind,
                                   interpret=interpret)

    def dense_causal():
      rows = jax.lax.dynamic_slice_in_dim(kv, l * T_cap, window)
      return dense_causal_attention(q_lat, proj.q_rope, rows, limit,
                                    scale=cfg.softmax_scale, scratch_bytes=scratch_bytes,
                                    kv_layout=kind)

    o_lat = jax.lax.cond(dense, dense_causal, sparse)
    out = layer.attn.out(o_lat)
    return out, {**c, "kv": kv, "entries": c["entries"].at[l].set(proj.entry)}

  x, carry = _run_layers(model, model.embed_tokens(tokens), pos, carry, select=select,
                         attend=attend)
  last = jnp.clip(jnp.asarray(length, jnp.int32) - 1, 0, C - 1)
  last_logits = model.logits(jax.lax.dynamic_slice_in_dim(x, last, 1))[0]
  return (carry["entries"], carry["keys_out"], last_logits,
          PrefillWorkspace(kv=carry["kv"], index_keys=carry["keys"]))


# ----------------------------------------------------------------------------------
# Dense reference decode
# ----------------------------------------------------------------------------------


def decode_dense_reference(model: Transformer, workspace: PrefillWorkspace,
                           tokens: jax.Array, positions: jax.Array):
  """One decode step over batched dense workspaces, with non-absorbed attention over
  every position masked to the indexer's selection.

  workspace: leaves [B, ...] (``init_workspace(cfg, T_cap, batch=B)``), holding
             positions < positions[b] of row b
  tokens, positions: [B] int32 (positions[b] < T_cap)
  returns (logits [B, V] float32, workspace with the new tokens written)
  """
  cfg = model.cfg
  B, T_cap, L = tokens.shape[0], workspace.capacity, cfg.num_layers
  rows = jnp.arange(B)
  positions = positions.astype(jnp.int32)
  ok = positions < T_cap
  cand = jnp.arange(T_cap, dtype=jnp.int32)[None, :] <= positions[:, None]
  carry = {"kv": workspace.kv, "keys": workspace.index_keys}

  def select(g, layers, first: IndexerInput, indexer: Indexer, c):
    del layers
    keys = c["keys"].at[rows, g, jnp.where(ok, positions, T_cap)].set(
        cfg.key_layout.encode(indexer.key(first.h, positions)), mode="drop")
    q_I, w = indexer.query(first.h, first.c_q, positions)
    sel_pos, sel_valid = select_topk(index_scores(q_I, w, cfg.key_layout.decode(keys[:, g])),
                                     cand, cfg.index_topk)
    # The selection as a [B, T_cap] mask (invalid picks land in a dropped extra column).
    mask = jnp.zeros((B, T_cap + 1), bool).at[
        rows[:, None], jnp.where(sel_valid, sel_pos, T_cap)].set(True)[:, :T_cap]
    return mask, {**c, "keys": keys}

  def attend(l, layer: DecoderLayer, proj: Projection, mask: jax.Array, c):
    kv = c["kv"].at[rows, jnp.where(ok, l * T_cap + positions, L * T_cap)].set(
        proj.entry, mode="drop")
    layer_kv = jax.lax.dynamic_slice_in_dim(kv, l * T_cap, T_cap, axis=1)  # [B, T_cap, W]
    out = layer.attn.naive(proj.q_nope, proj.q_rope, layer_kv, mask, cfg.softmax_scale)
    return out, {**c, "kv": kv}

  x, carry = _run_layers(model, model.embed_tokens(tokens), positions, carry, select=select,
                         attend=attend)
  return model.logits(x), PrefillWorkspace(kv=carry["kv"], index_keys=carry["keys"])


# ----------------------------------------------------------------------------------
# Jitted wrappers and a reference generator
# ----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0,),
                   static_argnames=("attention", "indexer", "scratch_bytes", "interpret"))
def prefill_chunk_jit(graphdef: nnx.GraphDef, params: nnx.State, workspace: PrefillWorkspace,
                      tokens: jax.Array, start: jax.Array, length: jax.Array, *,
                      attention: str = "xla", indexer: str = "xla",
                      scratch_bytes: int = SCRATCH_BYTES, interpret: bool | None = None):
  """``prefill_chunk`` on ``nnx.split(model)`` (graphdef static), jitted."""
  return prefill_chunk(nnx.merge(graphdef, params), workspace, tokens, start, length,
                       attention=attention, indexer=indexer, scratch_bytes=scratch_bytes,
                       interpret=interpret)


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
