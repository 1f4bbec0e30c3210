"""Multi-token prediction (MTP): the draft model of speculative decoding, and greedy
acceptance.

DeepSeek-V3's MTP module: the main model's last hidden state ``h_t`` (the final layer's
output, before the final norm) at position ``t`` and the embedding of the token at
``t + 1``, each RMS-normed, concatenated and projected back to the hidden size, go
through one more block that predicts the token at ``t + 2`` with the model's own (shared)
embedding and LM head. Its output is again a hidden state, so the block chains:
``draft_tokens`` runs it ``d`` times for ``d`` draft tokens (SGLang's NextN drafting with
one MTP layer). ``ula-jax train`` trains it beside the main model (``train.mtp_weight``).

The block is a dense SwiGLU block (RMSNorm, MLP, residual) without attention:
DeepSeek-V3's MTP block also attends, over a KV cache of its own; without attention the
draft reads no KV, so every memory system serves the same drafts and keeps only the
main model's entries. Drafts only decide how many tokens a verify step accepts, never
which tokens come out: greedy acceptance keeps a draft only where it equals the main
model's own greedy token (``accept_greedy``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ula_jax.models.config import ModelConfig
from ula_jax.models.layers import F32, MLP, RMSNorm, normal_param


class MTPBlock(nnx.Module):
  """concat(RMSNorm(h), RMSNorm(embedding)) W_proj -> x; x + MLP(RMSNorm(x)); a final
  norm of its own before the shared LM head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    D, dt, eps = cfg.hidden_size, cfg.dtype, cfg.rms_norm_eps
    self.hidden_norm = RMSNorm(D, eps, dt)
    self.embed_norm = RMSNorm(D, eps, dt)
    self.w_proj = normal_param(rngs, (2 * D, D), 2 * D, dt)
    self.ffn_norm = RMSNorm(D, eps, dt)
    self.ffn = MLP(D, cfg.intermediate_size, dt, rngs=rngs)
    self.final_norm = RMSNorm(D, eps, dt)

  def __call__(self, h_nd: jax.Array, e_nd: jax.Array) -> jax.Array:
    """h_nd: [N, D] hidden states at positions t; e_nd: [N, D] embeddings of the tokens
    at t + 1 -> [N, D] hidden states that predict the tokens at t + 2."""
    x_nd = jnp.concatenate([self.hidden_norm(h_nd), self.embed_norm(e_nd)], axis=-1)
    x_nd = x_nd @ self.w_proj[...]
    return x_nd + self.ffn(self.ffn_norm(x_nd))


def mtp_count(cfg: ModelConfig) -> dict[str, int]:
  """Parameters of the MTP block: {"matrix": projection and MLP, "vector": norms}."""
  D = cfg.hidden_size
  return {"matrix": 2 * D * D + 3 * D * cfg.intermediate_size, "vector": 4 * D}


def mtp_logits(model: Any, h_nd: jax.Array) -> jax.Array:
  """The MTP block's hidden states [N, D] -> [N, V] float32 through the shared LM head
  (``model``: a ``transformer.Transformer``)."""
  return jnp.einsum("nd,dv->nv", model.mtp.final_norm(h_nd), model.lm_head[...],
                    preferred_element_type=F32)


def draft_tokens(model: Any, hidden_nd: jax.Array, token_n: jax.Array, num: int
                 ) -> jax.Array:
  """``num`` greedy draft tokens per row, the MTP block chained.

  hidden_nd: [N, D] the main model's last hidden state (before its final norm) at the
             position whose greedy token is ``token_n``
  token_n:   [N] int32 that token (the one decoded next)
  returns    [N, num] int32: draft i is the guess for the token ``i + 1`` places after
             ``token_n``
  """
  if num == 0:
    return jnp.zeros((token_n.shape[0], 0), jnp.int32)

  def step(carry, _):
    h, tok = carry
    h = model.mtp(h, model.embed_tokens(tok))
    tok = jnp.argmax(mtp_logits(model, h), axis=-1).astype(jnp.int32)
    return (h, tok), tok

  _, drafts = jax.lax.scan(step, (hidden_nd, token_n.astype(jnp.int32)), length=num)
  return drafts.T


def accept_greedy(tokens_br: jax.Array, greedy_br: jax.Array, active_br: jax.Array
                  ) -> jax.Array:
  """Greedy acceptance of one verify step.

  tokens_br: [B, R] int32 the rows' input tokens: the last accepted token, then drafts
  greedy_br: [B, R] int32 the main model's greedy token after each row
  active_br: [B, R] bool rows that were verified (a request's first rows)
  returns [B] int32 drafts accepted: the longest run of drafts that each equal the
  greedy token of the row before; the request emits ``greedy_br[b, :accepted + 1]``,
  which are the tokens plain greedy decoding gives
  """
  match = (tokens_br[:, 1:] == greedy_br[:, :-1]) & active_br[:, 1:]
  return jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
