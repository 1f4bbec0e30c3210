"""ula_jax: one logical address space for the KV cache of sparse-attention decoding."""

__version__ = "0.1.0"
