"""Row copies through the ``ula_jax_ffi`` XLA custom calls (``impl='ffi'``).

The package lives in ``custom_calls/`` and is installed separately
(``pip install ./custom_calls``; add ``ULA_JAX_FFI_CUDA=ON`` for the CUDA handlers).
Importing it registers ``ula_jax_fetch_rows`` and ``ula_jax_evict_rows`` with jax.
"""

from __future__ import annotations

import jax

try:
  import ula_jax_ffi
except ImportError as e:  # optional: only impl='ffi' needs it
  ula_jax_ffi = None
  _IMPORT_ERROR: str | None = str(e)
else:
  _IMPORT_ERROR = None

INSTALL_HINT = "pip install ./custom_calls"
CUDA_HINT = "ULA_JAX_FFI_CUDA=ON pip install --no-build-isolation --no-deps ./custom_calls"


def available(backend: str | None = None) -> bool:
  """Whether the custom calls can run on ``backend`` (default: jax's default backend)."""
  if ula_jax_ffi is None:
    return False
  backend = backend or jax.default_backend()
  return backend == "cpu" or (backend in ("gpu", "cuda") and ula_jax_ffi.has_cuda())


def require(backend: str | None = None) -> None:
  """Raises RuntimeError saying how to build the custom calls when they cannot run."""
  backend = backend or jax.default_backend()
  if ula_jax_ffi is None:
    raise RuntimeError(f"kernels.fetch='ffi': ula_jax_ffi is not installed "
                       f"({_IMPORT_ERROR}): {INSTALL_HINT}")
  if backend in ("gpu", "cuda") and not ula_jax_ffi.has_cuda():
    raise RuntimeError(f"kernels.fetch='ffi': ula_jax_ffi was not compiled with CUDA "
                       f"support ({ula_jax_ffi.CUDA_IMPORT_ERROR}): {CUDA_HINT}")
  if backend not in ("cpu", "gpu", "cuda"):
    raise RuntimeError(f"kernels.fetch='ffi': no ula_jax_ffi handlers for backend "
                       f"{backend!r}; expected one of ['cpu', 'gpu']")


def _copy(target: str, src: jax.Array, src_idx: jax.Array, dst: jax.Array,
          dst_idx: jax.Array) -> jax.Array:
  require()
  if src_idx.shape[0] == 0:
    return dst
  # The result type is the destination's own (shape, dtype, sharding, memory space):
  # the custom call writes into the aliased destination buffer.
  call = jax.ffi.ffi_call(target, jax.typeof(dst), input_output_aliases={2: 0})
  return call(src, src_idx, dst, dst_idx)


def fetch_rows_ffi(host_pool: jax.Array, host_idx: jax.Array, dev_pool: jax.Array,
                   dev_idx: jax.Array) -> jax.Array:
  """``dev_pool[dev_idx[i]] = host_pool[host_idx[i]]`` (see ``fetch_rows``).

  host_pool: [Sh, W]; host_idx: [N] int32; dev_pool: [Sd, W]; dev_idx: [N] int32
  returns dev_pool: [Sd, W]
  """
  return _copy("ula_jax_fetch_rows", host_pool, host_idx, dev_pool, dev_idx)


def evict_rows_ffi(dev_pool: jax.Array, dev_idx: jax.Array, host_pool: jax.Array,
                   host_idx: jax.Array) -> jax.Array:
  """``host_pool[host_idx[i]] = dev_pool[dev_idx[i]]`` (see ``evict_rows``).

  dev_pool: [Sd, W]; dev_idx: [N] int32; host_pool: [Sh, W]; host_idx: [N] int32
  returns host_pool: [Sh, W] in the memory it came from
  """
  return _copy("ula_jax_evict_rows", dev_pool, dev_idx, host_pool, host_idx)
