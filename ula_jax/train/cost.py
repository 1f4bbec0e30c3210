"""What a training run costs in arithmetic, counted from its config.

Per trained token: ``6 x`` the matrix parameters every token passes through (forward 2,
backward 4; the model's MoE runs every expert on every token, so all experts count),
plus attention. Attention is computed in query blocks and masked (causal, or to the
selection); a block reads the positions up to the end of its segment
(``forward.key_segments``: 5/8 of the T x T square with four segments), and each pair
it reads costs ``2 H (dn + dr)`` for the scores and ``2 H dv`` for the values, four
times (forward, the recomputation under ``jax.checkpoint``, backward twice). The indexer
scores the same pairs once per group for the selection (``2 I K``, forward only; sparse
stage) and once per layer for the KL with its backward (four times; both stages, the
sparse one masking the scores to the picks). With
``train.trainable: mtp`` only the MTP block (and the LM head it passes through) has a
backward: the main model, its attention and the KL count once (forward only).

This counts multiply-adds only. At long sequences the work is dominated by the [H,
block, T] softmax blocks, which move far more bytes than they compute: read
``utilisation`` with that in mind.
"""

from __future__ import annotations

from ula_jax.models.config import ModelConfig
from ula_jax.models.mtp import mtp_count
from ula_jax.train.config import TrainConfig
from ula_jax.train.forward import key_segments


def matrix_params(m: ModelConfig) -> int:
  """Matrix parameters a token's forward passes through (embedding lookup excluded), the
  MTP block's included (with ``train.mtp_weight > 0`` its prediction also passes the
  LM head a second time: ``estimate`` adds that)."""
  D, H, Q, C = m.hidden_size, m.num_heads, m.q_lora_rank, m.kv_lora_rank
  dn, dr, dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
  attn = D * Q + Q * H * (dn + dr) + D * C + D * dr + H * C * (dn + dv) + H * dv * D
  dense = 3 * D * m.intermediate_size
  moe = (D * m.num_experts + 3 * m.num_experts * D * m.moe_intermediate_size
         + 3 * D * m.moe_intermediate_size * m.num_shared_experts)
  indexer = Q * m.index_n_heads * m.index_head_dim + D * m.index_head_dim + D * m.index_n_heads
  ffn = m.num_dense_layers * dense + (m.num_layers - m.num_dense_layers) * moe
  return (m.num_layers * attn + ffn + m.num_groups * indexer + D * m.vocab_size
          + mtp_count(m)["matrix"])


def all_params(m: ModelConfig) -> int:
  """Every parameter (matrices, embedding, norms)."""
  norms = m.num_layers * (2 * m.hidden_size + m.q_lora_rank + m.kv_lora_rank)
  return (matrix_params(m) + m.vocab_size * m.hidden_size + norms + m.hidden_size
          + m.num_groups * m.index_head_dim + mtp_count(m)["vector"])


def estimate(cfg: TrainConfig, peak_flops: float = 400e12,
             utilisation: tuple[float, float] = (0.3, 0.4)) -> dict:
  """FLOPs of the run and its time at ``peak_flops`` x ``utilisation``."""
  m, t = cfg.model, cfg.train
  T = t.seq_len
  segments = key_segments(T, cfg.block)
  pairs = sum((r1 - r0) * r1 for r0, r1 in segments) / T  # positions read per query
  tokens_per_step = t.batch_size * T
  mtp = mtp_count(m)["matrix"] + m.hidden_size * m.vocab_size  # the block, the head again
  main = matrix_params(m) - mtp_count(m)["matrix"]
  passes = 1 if t.trainable == "mtp" else 4  # forward only, or with recompute and backward
  mm = (2 if t.trainable == "mtp" else 6) * main + (6 * mtp if t.mtp_weight > 0 else 0)
  attn_pair = 2 * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
  attn = passes * attn_pair * pairs * m.num_layers
  index_pair = 2 * m.index_n_heads * m.index_head_dim
  select = index_pair * pairs * m.num_groups
  kl = passes * index_pair * pairs * m.num_layers
  per_token = {"dense": mm + attn + kl, "sparse": mm + attn + select + kl}
  total = tokens_per_step * (t.dense_steps * per_token["dense"]
                             + t.sparse_steps * per_token["sparse"])
  lo, hi = utilisation
  return {
      "params": all_params(m), "matrix_params": matrix_params(m),
      "tokens": tokens_per_step * t.steps, "tokens_per_step": tokens_per_step,
      "flops_per_token": per_token, "flops": float(total),
      "matmul_share": mm / per_token["sparse"],
      "peak_flops": peak_flops, "utilisation": list(utilisation),
      "seconds": [total / (peak_flops * hi), total / (peak_flops * lo)],
  }
