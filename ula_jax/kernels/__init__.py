"""Kernels, one folder per op: the public wrapper, a jnp reference with the same
signature (also the portable fallback) and optional accelerated implementations."""
