"""Geometry presets for ``ModelConfig`` (DESIGN.md §5).

The attention and KV geometry of ``glm5`` and ``dsv32`` (layers, dense layers, hidden,
heads, LoRA ranks, head dims, indexer heads x dim, top-k, index sharing) follows the
published models: one entry row is ``kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576``
values per layer. What decides only compute and weight memory is reduced: both presets
use 8 routed experts with 2 per token (the released models route 8 of 256), and the
remaining sizes (vocabulary, MLP widths, ``rope_theta``, ``max_position``) are
representative values, not those of any released checkpoint. No weights are downloaded
here; parameters come from ``param_seed``. Experiments keep the KV geometry and layer
count and shrink ``hidden_size`` / ``intermediate_size`` / ``moe_intermediate_size``
through fields, e.g. ``{'preset': 'glm5', 'hidden_size': 1024}``.

``small`` keeps the real MLA entry width (512 + 64) at a size a laptop decodes; ``tiny``
is for tests (fast on CPU, float32 everywhere).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=256, hidden_size=64, num_layers=4, num_dense_layers=1, num_heads=4,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, index_n_heads=4, index_head_dim=16, index_topk=8, index_share=2,
        intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_shared_experts=1, rope_theta=10000.0,
        rms_norm_eps=1e-6, max_position=4096, dtype="float32", kv_dtype="float32",
    ),
    "small": dict(
        vocab_size=4096, hidden_size=512, num_layers=8, num_dense_layers=2, num_heads=8,
        q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64,
        v_head_dim=64, index_n_heads=8, index_head_dim=64, index_topk=256, index_share=2,
        intermediate_size=1536, moe_intermediate_size=256, num_experts=8,
        num_experts_per_tok=2, num_shared_experts=1, rope_theta=10000.0,
        rms_norm_eps=1e-6, max_position=32768, dtype="float32", kv_dtype="bfloat16",
    ),
    "glm5": dict(
        vocab_size=154880, hidden_size=6144, num_layers=78, num_dense_layers=3,
        num_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128,
        index_topk=2048, index_share=4, intermediate_size=12288,
        moe_intermediate_size=2048, num_experts=8, num_experts_per_tok=2,
        num_shared_experts=1, rope_theta=1000000.0, rms_norm_eps=1e-5,
        max_position=202752, dtype="bfloat16", kv_dtype="bfloat16",
    ),
    "dsv32": dict(
        vocab_size=129280, hidden_size=7168, num_layers=61, num_dense_layers=3,
        num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128,
        index_topk=2048, index_share=1, intermediate_size=18432,
        moe_intermediate_size=2048, num_experts=8, num_experts_per_tok=2,
        num_shared_experts=1, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position=163840, dtype="bfloat16", kv_dtype="bfloat16",
    ),
}
