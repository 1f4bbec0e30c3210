"""XLA FFI custom calls for ula_jax: copy KV rows between pools by index lists.

Targets (registered with jax on import, for every platform this build supports):

* ``ula_jax_fetch_rows(host_pool [Sh, W], host_idx [N] int32, dev_pool [Sd, W],
  dev_idx [N] int32) -> dev_pool``: ``dev_pool[dev_idx[i]] = host_pool[host_idx[i]]``
* ``ula_jax_evict_rows(dev_pool [Sd, W], dev_idx [N] int32, host_pool [Sh, W],
  host_idx [N] int32) -> host_pool``: ``host_pool[host_idx[i]] = dev_pool[dev_idx[i]]``

Pairs with an index outside its pool are skipped. The result aliases the destination
pool (call through ``jax.ffi.ffi_call`` with ``input_output_aliases={2: 0}``).

The CPU handlers are always built; the CUDA handlers only when the package was built
with ``ULA_JAX_FFI_CUDA=ON`` (see ``has_cuda``).
"""

from __future__ import annotations

import jax

from ula_jax_ffi import _cpu

TARGETS = ("ula_jax_fetch_rows", "ula_jax_evict_rows")

try:
  from ula_jax_ffi import _cuda
except ImportError as e:  # built without CUDA, or the CUDA runtime cannot be loaded
  _cuda = None
  CUDA_IMPORT_ERROR: str | None = str(e)
else:
  CUDA_IMPORT_ERROR = None

for _name, _capsule in _cpu.registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
if _cuda is not None:
  for _name, _capsule in _cuda.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def has_cuda() -> bool:
  """True when the CUDA handlers were built and loaded."""
  return _cuda is not None


def platforms() -> tuple[str, ...]:
  """Platforms with registered handlers (``'cpu'``, and ``'cuda'`` when built)."""
  return ("cpu", "cuda") if _cuda is not None else ("cpu",)


__all__ = ["TARGETS", "CUDA_IMPORT_ERROR", "has_cuda", "platforms"]
