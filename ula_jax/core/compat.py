"""The one place where jax 0.10 and 0.11 differ for this project.

* ``compute_on`` is a context manager in 0.10 and a decorator (``compute_type=``,
  ``out_memory_spaces=``) in 0.11; 0.10 has the decorator as ``compute_on2``.
  ``on_host(fn, *args)`` runs ``fn`` on the host under either version.
* ``jax.memory.Space`` names the memory spaces used with ``device_put`` inside jit.
* ``distributed_client()``: the coordinator's key-value store, which jax exposes only
  privately (``jax._src.distributed.global_state.client``) in both versions.
* Pallas's Triton lowering takes its target GPU from the default device in 0.11 (none in
  0.10), so lowering for CUDA on a CPU machine needs ``triton_target()`` (``lower_for``
  lowers under it).
* A ``scan`` equation counts its constants and carries in params ``num_consts`` /
  ``num_carry`` in 0.10 and in a flat tree ``ft_in`` in 0.11: ``scan_operand_counts``.
* jax's DLPack import takes pinned host memory (``kDLCUDAHost``) from jaxlib's extension
  version 467 on (0.10.2 and 0.11 have it; the check reads the private version number):
  ``dlpack_takes_pinned_host``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
from jax.experimental import compute_on as _compute_on_mod

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


# The decorator form: ``compute_on2`` in 0.10, ``compute_on`` in 0.11 (where the 0.10
# context manager is gone). Both take ``compute_type=`` and ``out_memory_spaces=``.
_compute_on_decorator = getattr(_compute_on_mod, "compute_on2", None) or _compute_on_mod.compute_on


def on_host(fn: Callable[..., Any], *args: Any) -> Any:
  """Runs ``fn(*args)`` with host compute (``compute_type='device_host'``) inside jit.

  Operands must already live in host memory (``to_host``); every output stays there.
  """
  spaces = jax.tree.map(lambda _: HOST, jax.eval_shape(fn, *args))
  return _compute_on_decorator(compute_type="device_host", out_memory_spaces=spaces)(fn)(*args)


def to_host(x: jax.Array) -> jax.Array:
  """Moves a traced value to host memory (inside jit)."""
  return jax.device_put(x, HOST)


def to_device(x: jax.Array) -> jax.Array:
  """Moves a traced value to device memory (inside jit)."""
  return jax.device_put(x, DEVICE)


def shard_map(f, *, mesh, in_specs, out_specs, check_vma: bool = False):
  """``jax.shard_map`` with replication checks off (memory systems index with
  per-device values, which the checker cannot follow)."""
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=check_vma)


def distributed_client() -> Any | None:
  """``jax.distributed``'s client of the coordinator's key-value store (a private
  attribute in jax 0.10 and 0.11), or None before ``jax.distributed.initialize``."""
  from jax._src import distributed
  return distributed.global_state.client


@contextlib.contextmanager
def triton_target(device_kind: str = "NVIDIA H100"):
  """Lowering Pallas's Triton kernels for CUDA where the default device is no GPU (a CPU
  machine reading what a kernel becomes): jax 0.11 takes the Triton target from the
  default device and refuses a CPU one; here it is the GPU named ``device_kind`` (a
  Hopper by default). jax 0.10 needs no target to lower; on a GPU nothing changes."""
  try:
    from jax._src.interpreters import pxla
    from jax._src.pallas.triton import gpu_info
  except ImportError:  # jax 0.10: the lowering takes no target
    yield
    return
  default = pxla.get_default_device()
  if default.platform in ("gpu", "cuda", "rocm"):
    yield
    return
  version = gpu_info.gpu_version_from_device_kind(device_kind)
  if version is None:
    raise ValueError(f"device_kind={device_kind!r}: not a GPU jax's Triton lowering knows")
  kind, before = default.device_kind, gpu_info.registry.get(default.device_kind)
  gpu_info.registry[kind] = lambda: gpu_info.get_gpu_info_from_version(version)
  try:
    yield
  finally:
    if before is None:
      gpu_info.registry.pop(kind, None)
    else:
      gpu_info.registry[kind] = before


def lower_for(traced: Any, platforms: tuple[str, ...] = ("cuda",)) -> Any:
  """``traced`` (``jax.jit(f).trace(...)``) lowered for ``platforms`` on any machine, the
  Triton target set where the default device is no GPU (``triton_target``)."""
  with triton_target():
    return traced.lower(lowering_platforms=tuple(platforms))


def scan_operand_counts(params: dict) -> tuple[int, int]:
  """(constants, carries) among a ``scan`` equation's operands, from its params: 0.10
  has ``num_consts`` and ``num_carry``, 0.11 a flat tree ``ft_in`` of (constants,
  carries, scanned)."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(list(consts)), len(list(carry))


def dlpack_takes_pinned_host() -> bool:
  """Whether ``jax.dlpack.from_dlpack`` views pinned host memory (``kDLCUDAHost``) as a
  ``pinned_host`` array of a GPU (jaxlib's extension version 467 and later)."""
  from jax._src.lib import jaxlib_extension_version
  return jaxlib_extension_version >= 467
