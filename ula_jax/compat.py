"""The one place where jax 0.10 and 0.11 differ for this project.

* ``compute_on`` is a context manager in 0.10 and a decorator (``compute_type=``,
  ``out_memory_spaces=``) in 0.11. ``on_host(fn, *args)`` runs ``fn`` on the host
  under either spelling.
* ``jax.memory.Space`` names the memory spaces used with ``device_put`` inside jit.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

import jax
from jax.experimental import compute_on as _compute_on_mod

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


def _compute_on_is_context_manager() -> bool:
  fn = _compute_on_mod.compute_on
  if inspect.isgeneratorfunction(getattr(fn, "__wrapped__", fn)):
    return True
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return True
  # 0.10: compute_on(compute_type: str); 0.11: compute_on(f=None, *, compute_type, ...)
  return "compute_type" in params and list(params)[0] == "compute_type"


_CM = _compute_on_is_context_manager()


def on_host(fn: Callable[..., Any], *args: Any) -> Any:
  """Runs ``fn(*args)`` with host compute (``compute_on('device_host')``).

  Operands must already live in host memory (``to_host``); the result stays there.
  """
  if _CM:
    with _compute_on_mod.compute_on("device_host"):
      return fn(*args)
  return _compute_on_mod.compute_on(compute_type="device_host")(fn)(*args)


def to_host(x: jax.Array) -> jax.Array:
  """Moves a traced value to host memory (inside jit)."""
  return jax.device_put(x, HOST)


def to_device(x: jax.Array) -> jax.Array:
  """Moves a traced value to device memory (inside jit)."""
  return jax.device_put(x, DEVICE)


@contextlib.contextmanager
def nullcontext():
  yield


def shard_map(f, *, mesh, in_specs, out_specs, check_vma: bool = False):
  """``jax.shard_map`` with replication checks off (memory systems index with
  per-device values, which the checker cannot follow)."""
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=check_vma)
