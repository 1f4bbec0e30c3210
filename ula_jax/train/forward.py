"""The training forward: the model's layer stack with attention in query blocks, dense or
restricted to the indexer's top-k, and the indexer's KL loss.

Serving runs MLA in absorbed form over stored entries; training runs the same
parameters in the non-absorbed form (per-head keys ``c W_uk`` and values ``c W_uv``
computed once per sequence from the stored-precision entries), which is the same
function with about a fifth of the attention arithmetic. The layer stack is the model's
own (``transformer._run_layers``: one ``lax.scan`` per segment of stacked layer groups);
only the ``select`` and ``attend`` callbacks are the training ones.

Two stages, as DeepSeek-V3.2 trained its indexer:

* ``dense``: each query attends over every position up to itself. The group's indexer
  scores the same positions and is trained to match each layer's attention distribution
  (averaged over heads, normalised, gradient stopped) by KL(p_attn || softmax(scores)).
* ``sparse``: each query attends over the top-k positions its group's indexer picks
  (``kernels.indexer.select_topk``'s set, exactly as serving picks them; every position
  while a query has at most k candidates). The KL is over the selected positions only.
  With ``train.concentration_weight`` (not DeepSeek-V3.2's recipe) each head's dense
  attention is also asked to keep its mass on the picks (``ForwardOptions.spill``).

A group's selection is found once (``selection_bits``: by radix select on a GPU, no
sort) and kept as bit rows, [T, T / 32] uint32; each layer's query block unpacks its
rows into the mask its attention and KL are taken over, so the sparse stage costs what
the dense one does plus the selection: no gather of the picked positions' keys, and no
scatter of their gradients.

In both, the MTP block (``models.mtp``, the speculative drafts' block) learns to predict
the token two places ahead from each position's final hidden state and the next token's
embedding, through the shared LM head (``mtp_loss_sum``; DeepSeek-V3's MTP loss at depth
one), and its gradient reaches the whole model as in DeepSeek-V3.

The indexer reads its inputs with the gradient stopped, so it learns only from the KL,
and the rest of the model only from the language-model loss; the selection itself
carries no gradient.

Memory: a query block holds its [H, block, T] scores (and, for the KL, the
indexer's [block, I, T] head scores) and nothing more; each block runs under
``jax.checkpoint``, so the backward pass recomputes a block's scores rather than keeping
them, and the sequence's attention never exists whole (at T = 16K, 8 heads, the full
score tensor would be 8 GiB in float32 per layer). The KL is computed for every query,
in the same blocks, not on a sample. The language-model head runs in blocks too, so the
[T, vocab] logits never exist whole either. Query blocks come in up to four segments
(``key_segments``) that read only the positions up to their segment's end, which skips
most of the causally masked half of the square.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

from ula_jax.kernels.indexer import index_scores, select_topk
from ula_jax.kernels.indexer.topk import topk_mask
from ula_jax.kernels.sparse_attention.reference import masked_softmax
from ula_jax.models.layers import Indexer
from ula_jax.models.mtp import mtp_logits
from ula_jax.models.transformer import DecoderLayer, Projection, Transformer, _run_layers

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
  """What one forward computes (hashable: a static argument of the jitted steps).

  sparse:  main attention over the indexer's top-k (else dense causal)
  block:   query rows per attention block (divides the sequence length)
  kl:      the indexer's KL loss
  measure: the share of each layer's dense attention that the top-k captures (with
           ``sparse=False``; evaluation)
  mtp:     the MTP block's loss
  spill:   (with ``sparse``) the share of each head's dense attention outside the picks,
           as -log of the share inside (``train.concentration_weight``)
  """

  sparse: bool
  block: int
  kl: bool = True
  measure: bool = False
  mtp: bool = True
  spill: bool = False


class IndexerInputs(NamedTuple):
  """A group's indexer, evaluated on its first layer's projection (gradient stopped at
  its inputs), and its selection when one is needed."""

  q_I: jax.Array  # [T, I, K]
  w: jax.Array  # [T, I] float32
  keys: jax.Array  # [T, K] kv_dtype
  sel_bits: jax.Array | None  # [T, ceil(T / 32)] uint32: ``selection_bits``
  top_k: int = 0  # the selection's k (0 without one)


def _blocks(x: jax.Array, block: int) -> jax.Array:
  """[T, ...] -> [T / block, block, ...]."""
  return x.reshape(x.shape[0] // block, block, *x.shape[1:])


def key_segments(T: int, block: int) -> list[tuple[int, int]]:
  """The sequence's query rows in up to four segments of whole blocks: the queries of a
  segment ending at row r read only the positions < r (causality), so the work of the
  [block, positions] score blocks is (S + 1) / 2S of the full square (5/8 for S = 4)."""
  nb = T // block
  S = next(s for s in (4, 2, 1) if nb % s == 0)
  step = T // S
  return [(i * step, (i + 1) * step) for i in range(S)]


WORD = 32  # positions per word of a selection's bit rows


def pack_bits(mask_nt: jax.Array) -> jax.Array:
  """[N, T] bool -> [N, ceil(T / 32)] uint32 (position t is bit t % 32 of word t // 32)."""
  N, T = mask_nt.shape
  W = -(-T // WORD)
  m = jnp.pad(mask_nt, ((0, 0), (0, W * WORD - T))).reshape(N, W, WORD)
  return jnp.sum(m.astype(jnp.uint32) << jnp.arange(WORD, dtype=jnp.uint32), axis=-1,
                 dtype=jnp.uint32)  # distinct bits: the sum is their OR


def unpack_bits(words_nw: jax.Array, T: int) -> jax.Array:
  """``pack_bits``'s inverse for the first T positions: [N, W] uint32 -> [N, T] bool."""
  N, W = words_nw.shape
  bits = (words_nw[:, :, None] >> jnp.arange(WORD, dtype=jnp.uint32)) & 1
  return bits.astype(bool).reshape(N, W * WORD)[:, :T]


def _selection_mask(sel_pos: jax.Array, sel_valid: jax.Array, T: int) -> jax.Array:
  """[N, k] selected positions -> [N, T] bool."""
  N = sel_pos.shape[0]
  rows = jnp.arange(N)[:, None]
  cols = jnp.where(sel_valid, sel_pos, T)  # invalid picks land in a dropped column
  return jnp.zeros((N, T + 1), bool).at[rows, cols].set(True)[:, :T]


def _sorted_mask(scores_nt: jax.Array, cand_nt: jax.Array, k: int) -> jax.Array:
  """``select_topk``'s picks (``lax.top_k``) as a [N, T] mask."""
  return _selection_mask(*select_topk(scores_nt, cand_nt, k), scores_nt.shape[1])


def _picks(scores_nt: jax.Array, cand_nt: jax.Array, k: int, radix: bool | None
           ) -> jax.Array:
  """``select_topk``'s picks as a mask: by radix select (``topk_mask``: no sort, no
  scatter) or by ``lax.top_k`` and a scatter; None: the radix select except on a CPU,
  whose top-k is no sort and many times faster than the counting passes there."""
  if radix is None:
    return jax.lax.platform_dependent(
        scores_nt, cand_nt, cpu=lambda s, c: _sorted_mask(s, c, k),
        default=lambda s, c: topk_mask(s, c, k))
  return topk_mask(scores_nt, cand_nt, k) if radix else _sorted_mask(scores_nt, cand_nt, k)


def selection_bits(q_I: jax.Array, w: jax.Array, keys: jax.Array, k: int, block: int, *,
                   radix: bool | None = None) -> jax.Array:
  """Each position's top-k among the positions up to itself (``select_topk``'s set,
  exactly as serving picks it), in query blocks, as bit rows.

  q_I: [T, I, K]; w: [T, I]; keys: [T, K]
  radix: as ``_picks``'s
  returns [T, ceil(T / 32)] uint32: bit t of row n set where position t is picked for
  query n (``pack_bits``; T^2 / 8 bytes: a quarter of the picks as [T, k] int32 at
  k = T / 8, a 16K window's top-2048)
  """
  T = keys.shape[0]
  W = -(-T // WORD)
  pos = jnp.arange(T, dtype=jnp.int32)
  out = []
  for r0, r1 in key_segments(T, block):

    def body(_, xs, r1=r1):
      q_blk, w_blk, p_blk = xs
      cand = pos[None, :r1] <= p_blk[:, None]
      words = pack_bits(_picks(index_scores(q_blk, w_blk, keys[:r1]), cand, k, radix))
      return None, jnp.pad(words, ((0, 0), (0, W - words.shape[1])))

    _, bits = jax.lax.scan(body, None, (_blocks(q_I[r0:r1], block),
                                        _blocks(w[r0:r1], block),
                                        _blocks(pos[r0:r1], block)))
    out.append(bits.reshape(r1 - r0, W))
  return jnp.concatenate(out)


def _log_softmax(z: jax.Array, mask: jax.Array) -> jax.Array:
  """log softmax of ``z`` over ``mask`` along the last axis; 0 outside the mask (every
  row has at least one position in the mask)."""
  lse = jax.nn.logsumexp(jnp.where(mask, z, -jnp.inf), axis=-1, keepdims=True)
  return jnp.where(mask, z - lse, 0.0)


def _kl_rows(p: jax.Array, log_q: jax.Array, mask: jax.Array) -> jax.Array:
  """KL(p || q) per row over ``mask``: [N, T] -> [N] (p sums to 1 over the mask)."""
  return jnp.sum(jnp.where(mask, xlogy(p, p) - p * log_q, 0.0), axis=-1)


def layer_attention(layer: DecoderLayer, proj: Projection, ix: IndexerInputs,
                    scale: float, opts: ForwardOptions) -> tuple[jax.Array, dict]:
  """One layer's attention over a whole sequence, in query blocks.

  returns (output [T, D], {"kl": [] KL summed over queries, "mass": [] captured
  attention summed over queries, "mass_far": the same over queries with more than k
  candidates, "oracle_far": what the attention's own top-k holds over those queries,
  "spill": -log of the share of each head's dense attention that the picks hold, the
  heads' mean summed over queries}); the sums are 0 where ``opts`` does not ask for them.
  """
  attn = layer.attn
  dt = attn.w_uk[...].dtype
  T, C = proj.entry.shape[0], attn.kv_lora_rank
  c_tc = proj.entry[:, :C].astype(dt)
  kr_tr = proj.entry[:, C:].astype(dt)
  k_thd = jnp.einsum("tc,hcd->thd", c_tc, attn.w_uk[...])
  v_thv = jnp.einsum("tc,hcv->thv", c_tc, attn.w_uv[...])
  pos = jnp.arange(T, dtype=jnp.int32)
  keys = ix.keys
  want_sel = opts.sparse or opts.measure
  k = ix.top_k

  def segment(r0: int, r1: int):
    """The queries of rows [r0, r1) over positions < r1 (those after are all masked)."""
    k_, v_, kr_, keys_, pos_ = k_thd[:r1], v_thv[:r1], kr_tr[:r1], keys[:r1], pos[:r1]

    @jax.checkpoint
    def body(_, xs):
      qn, qr, qpos, q_I, w, bits = xs
      causal = pos_[None, :] <= qpos[:, None]  # [Bq, r1]
      picked = unpack_bits(bits[:, :-(-r1 // WORD)], r1) if want_sel else None
      allowed = picked if opts.sparse else causal  # the picks are causal
      s_hqt = (jnp.einsum("qhd,thd->hqt", qn, k_, preferred_element_type=F32)
               + jnp.einsum("qhr,tr->hqt", qr, kr_, preferred_element_type=F32)) * scale
      p_hqt = masked_softmax(s_hqt, allowed[None])
      o_qhv = jnp.einsum("hqt,thv->qhv", p_hqt.astype(dt), v_, preferred_element_type=F32)
      p_qt = jax.lax.stop_gradient(jnp.mean(p_hqt, axis=0))  # the heads' distribution
      kl = mass = mass_far = oracle_far = spill = jnp.zeros((), F32)
      if opts.sparse and opts.spill:  # log-sum-exp over every earlier position - the picks'
        lse = lambda m: jax.nn.logsumexp(jnp.where(m[None], s_hqt, -jnp.inf), axis=-1)
        spill = jnp.sum(jnp.mean(lse(causal) - lse(picked), axis=0))
      if opts.kl:  # over the positions attended: every earlier one, or the picks
        log_q = _log_softmax(index_scores(q_I, w, keys_), allowed)
        kl = jnp.sum(_kl_rows(p_qt, log_q, allowed))
      if opts.measure:
        got = jnp.sum(jnp.where(picked, p_qt, 0.0), axis=-1)
        mass = jnp.sum(got)
        mass_far = jnp.sum(jnp.where(qpos >= k, got, 0.0))
        # The most any k positions could hold: the attention's own top-k.
        best = jnp.sum(jax.lax.top_k(p_qt, min(k, r1))[0], axis=-1)
        oracle_far = jnp.sum(jnp.where(qpos >= k, best, 0.0))
      return None, (o_qhv.astype(dt), kl, mass, mass_far, oracle_far, spill)

    b = opts.block
    rows = lambda x: _blocks(x[r0:r1], b)
    bits = ix.sel_bits if want_sel else jnp.zeros((T, 1), jnp.uint32)
    xs = (rows(proj.q_nope), rows(proj.q_rope), rows(pos), rows(ix.q_I), rows(ix.w),
          rows(bits))
    _, (o, *sums) = jax.lax.scan(body, None, xs)
    return o.reshape(r1 - r0, *o.shape[2:]), [jnp.sum(x) for x in sums]

  parts = [segment(r0, r1) for r0, r1 in key_segments(T, opts.block)]
  o_thv = jnp.concatenate([p[0] for p in parts])
  kl, mass, mass_far, oracle_far, spill = (sum(p[1][i] for p in parts) for i in range(5))
  out = jnp.einsum("thv,hvd->td", o_thv, attn.w_o[...])
  return out, {"kl": kl, "mass": mass, "mass_far": mass_far, "oracle_far": oracle_far,
               "spill": spill}


def lm_loss_sum(model: Transformer, x_td: jax.Array, targets: jax.Array, block: int
                ) -> jax.Array:
  """Summed cross-entropy (nats) of the final hidden states [T, D] against ``targets``
  [T] int32, in blocks of ``block`` rows (the [T, V] logits never exist whole)."""

  @jax.checkpoint
  def body(total, xs):
    x_blk, t_blk = xs
    logits = model.logits(x_blk)  # [Bq, V] float32
    lse = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, t_blk[:, None], axis=-1)[:, 0]
    return total + jnp.sum(lse - gold), None

  total, _ = jax.lax.scan(body, jnp.zeros((), F32), (_blocks(x_td, block),
                                                     _blocks(targets, block)))
  return total


def mtp_loss_sum(model: Transformer, x_td: jax.Array, targets: jax.Array, block: int
                 ) -> jax.Array:
  """Summed cross-entropy (nats) of the MTP block: at position t it reads the final hidden
  state ``x_td[t]`` [T, D] and the embedding of ``targets[t]`` (the token at t + 1) and
  predicts ``targets[t + 1]``; the last position, with nothing two places ahead in the
  window, is left out. In blocks of ``block`` rows, as ``lm_loss_sum``."""
  T = x_td.shape[0]
  ahead = jnp.concatenate([targets[1:], targets[:1]])  # the last row's is a placeholder
  keep = jnp.arange(T) < T - 1

  @jax.checkpoint
  def body(total, xs):
    x_blk, next_blk, ahead_blk, keep_blk = xs
    logits = mtp_logits(model, model.mtp(x_blk, model.embed_tokens(next_blk)))
    lse = jax.nn.logsumexp(logits, axis=-1)
    gold = jnp.take_along_axis(logits, ahead_blk[:, None], axis=-1)[:, 0]
    return total + jnp.sum(jnp.where(keep_blk, lse - gold, 0.0)), None

  xs = tuple(_blocks(a, block) for a in (x_td, targets, ahead, keep))
  total, _ = jax.lax.scan(body, jnp.zeros((), F32), xs)
  return total


def sequence_terms(model: Transformer, tokens: jax.Array, targets: jax.Array,
                   opts: ForwardOptions) -> dict[str, jax.Array]:
  """The loss terms of one sequence.

  tokens, targets: [T] int32 (targets[t] follows tokens[t])
  returns {"lm": [] summed cross-entropy (nats), "mtp": [] the MTP block's summed
  cross-entropy over the T - 1 positions with a token two places ahead (0 without
  ``opts.mtp``), "kl": [L] per layer KL summed over
  queries, "mass": [L], "mass_far": [L] captured attention summed over queries (all, and
  those with more than k candidates), "oracle_far": [L] the attention's own top-k mass
  over the latter, "spill": [L] the attention's spill outside the picks summed over
  queries (``layer_attention``)}
  """
  cfg = model.cfg
  T, L = tokens.shape[0], cfg.num_layers
  pos = jnp.arange(T, dtype=jnp.int32)
  zeros = jnp.zeros((L,), F32)
  carry = {"kl": zeros, "mass": zeros, "mass_far": zeros, "oracle_far": zeros,
           "spill": zeros}

  def select(g, layers, first: Projection, indexer: Indexer, c):
    del g, layers
    h = jax.lax.stop_gradient(first.h)
    keys = indexer.key(h, pos)
    q_I, w = indexer.query(h, jax.lax.stop_gradient(first.c_q), pos)
    if not (opts.sparse or opts.measure):
      return IndexerInputs(q_I, w, keys, None), c
    stop = jax.lax.stop_gradient
    bits = selection_bits(stop(q_I), stop(w), stop(keys), cfg.index_topk, opts.block)
    return IndexerInputs(q_I, w, keys, bits, cfg.index_topk), c

  def attend(l, layer: DecoderLayer, proj: Projection, ix: IndexerInputs, c):
    out, terms = layer_attention(layer, proj, ix, cfg.softmax_scale, opts)
    return out, {name: c[name].at[l].set(terms[name]) for name in c}

  x, carry = _run_layers(model, model.embed_tokens(tokens), pos, carry, select=select,
                         attend=attend)
  mtp = (mtp_loss_sum(model, x, targets, opts.block) if opts.mtp
         else jnp.zeros((), F32))
  return {"lm": lm_loss_sum(model, x, targets, opts.block), "mtp": mtp, **carry}


def read_selections(model: Transformer, tokens: jax.Array, first: int, block: int
                    ) -> jax.Array:
  """What each layer group's indexer selects at every position from ``first`` on while
  the model reads ``tokens`` [T] int32 (teacher forcing: the text in place of generated
  tokens), with attention over the picks, as served: ``select_topk``'s picks in its
  order.

  first: the first position whose selections are returned ((T - first) a multiple of
    ``block``); block: query rows per block
  returns [T - first, G, k] int32 positions, -1 past a position's candidates; row j is
  position first + j, as the rows of SGLang's ``indexer_topk`` (one indexer layer per
  group), which ``ula-jax trace import`` reads
  """
  cfg = model.cfg
  T, k, G = tokens.shape[0], cfg.index_topk, cfg.num_groups
  if not 0 <= first < T or (T - first) % block:
    raise ValueError(f"read_selections: first={first} must be in [0, {T}) with T - first "
                     f"a multiple of block={block}")
  pos = jnp.arange(T, dtype=jnp.int32)
  opts = ForwardOptions(True, block, kl=False, mtp=False)

  def select(g, layers, first_proj: Projection, indexer: Indexer, c):
    del layers
    keys = indexer.key(first_proj.h, pos)
    q_I, w = indexer.query(first_proj.h, first_proj.c_q, pos)

    def body(_, xs):  # one selection per query: its picks, and its bit row for attention
      q_blk, w_blk, p_blk = xs
      picks, valid = select_topk(index_scores(q_blk, w_blk, keys),
                                 pos[None, :] <= p_blk[:, None], k)
      return None, (jnp.where(valid, picks, -1).astype(jnp.int32),
                    pack_bits(_selection_mask(picks, valid, T)))

    _, (picks, bits) = jax.lax.scan(body, None, (_blocks(q_I, block), _blocks(w, block),
                                                 _blocks(pos, block)))
    picks = picks.reshape(T, k)[first:]
    return IndexerInputs(q_I, w, keys, bits.reshape(T, -1), k), c.at[g].set(picks)

  def attend(l, layer: DecoderLayer, proj: Projection, ix: IndexerInputs, c):
    del l
    return layer_attention(layer, proj, ix, cfg.softmax_scale, opts)[0], c

  _, sel = _run_layers(model, model.embed_tokens(tokens), pos,
                       jnp.full((G, T - first, k), -1, jnp.int32), select=select,
                       attend=attend)
  return jnp.transpose(sel, (1, 0, 2))


def batch_terms(model: Transformer, windows: jax.Array, opts: ForwardOptions
                ) -> dict[str, jax.Array]:
  """``sequence_terms`` of every window of [B, T + 1] int32 tokens, each with a leading
  [B] axis."""
  return jax.vmap(lambda w: sequence_terms(model, w[:-1], w[1:], opts))(windows)


def terms_summary(terms: dict[str, Any], seq_len: int, top_k: int) -> dict[str, Any]:
  """Per-token means of ``batch_terms`` (summed over the batch first): ``lm`` nats per
  token, ``mtp`` nats per predicted token (T - 1 per window), ``kl`` per query and
  layer, ``mass`` / ``mass_far`` per query, per layer [L], ``spill`` per query and
  layer [L]."""
  B = terms["lm"].shape[0]
  far = B * max(seq_len - top_k, 0)
  return {
      "lm": jnp.sum(terms["lm"]) / (B * seq_len),
      "mtp": jnp.sum(terms["mtp"]) / (B * max(seq_len - 1, 1)),
      "kl": jnp.sum(terms["kl"], axis=0) / (B * seq_len),
      "spill": jnp.sum(terms["spill"], axis=0) / (B * seq_len),
      "mass": jnp.sum(terms["mass"], axis=0) / (B * seq_len),
      "mass_far": jnp.sum(terms["mass_far"], axis=0) / max(far, 1),
      "oracle_far": jnp.sum(terms["oracle_far"], axis=0) / max(far, 1),
  }
