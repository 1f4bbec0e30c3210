"""Memory systems: where each KV entry lives, behind one interface (``base.MemorySystem``)."""

from __future__ import annotations

from typing import Any

from ula_jax.config import ConfigError, ExperimentConfig
from ula_jax.config.schema import MemoryConfig
from ula_jax.core.host_memory import HOST_LIMIT_ENV, MIN_RESERVE_GIB, host_ram, pinned_host_limit
from ula_jax.core.sizes import parse_size
from ula_jax.core.types import INVALID, KVGeometry, MeshInfo, Resolution
from ula_jax.memory.base import CapacityReport, MemorySystem
from ula_jax.memory.registry import REGISTRY, SYSTEM_NAMES, lookup, system_class


def build_memory_system(cfg: MemoryConfig, geometry: KVGeometry, mesh_info: MeshInfo, *,
                        max_batch: int, page_size: int, max_context: int,
                        fetch_impl: str = "xla", resolve_impl: str = "jnp",
                        resolve_fast_path: bool = True, decode_scores: str = "auto",
                        decode_topk: str = "sort", interpret: bool | None = None,
                        step_rows: int = 1, synthetic_selection: Any = None
                        ) -> MemorySystem:
  """Instantiates ``cfg.system`` and validates its sizes (before any compute).

  The class comes from ``registry.REGISTRY`` by ``cfg.system`` and the mesh's mode
  (``ula``: ``dp`` when ``mesh_info.tp == 1``, ``tp`` otherwise).

  fetch_impl / resolve_impl: the ``kernels.fetch`` / ``kernels.resolve`` implementations
  its row copies and resolve use; resolve_fast_path: ``kernels.resolve_fast_path`` (steps
  that move nothing take the all-hit fast path); decode_scores: ``kernels.decode_scores``
  (how ``select`` scores a decode step's rows, resolved by ``decode.scores_mode``);
  decode_topk: ``kernels.decode_topk`` ('sort' or 'radix', resolved by
  ``decode.topk_mode``); interpret: run Pallas kernels in interpret mode; step_rows:
  query rows per request in one decode step (``1 + speculative.num_draft``);
  synthetic_selection: ``workload.selections: synthetic``'s
  ``kernels.indexer.synthetic.SyntheticSelection`` (None: the indexer ranks).
  """
  cls = system_class(cfg.system, mesh_info.tp)
  system = cls(cfg, geometry, mesh_info, max_batch=max_batch, page_size=page_size,
               max_context=max_context, step_rows=step_rows)
  system.fetch_impl, system.fetch_interpret = fetch_impl, interpret
  system.resolve_impl, system.resolve_interpret = resolve_impl, interpret
  system.resolve_fast_path = resolve_fast_path
  system.decode_scores = decode_scores
  system.decode_topk = decode_topk
  system.synthetic_selection = synthetic_selection
  system.indexer_interpret = interpret
  system.validate()
  return system


def sized_system(cfg: ExperimentConfig) -> MemorySystem:
  """The memory system of ``cfg`` sized and validated as the engine builds it, with no
  array allocated (``setup`` and ``validate`` read only the config); ConfigError for sizes
  that can never work."""
  page = cfg.engine.page_size
  # The engine rounds max_context up to a page; validation has filled it when unset.
  max_context = -(-cfg.engine.max_context // page) * page
  try:
    cls = system_class(cfg.memory.system, cfg.mesh.tp)
    system = cls(cfg.memory, cfg.model.kv_geometry(), MeshInfo(cfg.mesh.dp, cfg.mesh.tp),
                 max_batch=cfg.engine.max_batch, page_size=page, max_context=max_context,
                 step_rows=cfg.speculative.rows)
    system.validate()
  except ConfigError:
    raise
  except ValueError as e:
    raise ConfigError([str(e)]) from None
  if max(system.num_logical, system.capacity_tokens) > MAX_ADDRESSES:
    # Logical addresses, slots and page tables are int32 on the device.
    sizes = [f"memory.device_pool={cfg.memory.device_pool!r}"]
    if cfg.memory.system in ("ula", "hisparse"):
      sizes.append(f"memory.host_pool={cfg.memory.host_pool!r}")
    if cfg.memory.system == "far_tier":
      sizes.append(f"memory.far_tier.far_pool={cfg.memory.far_tier.far_pool!r}")
    raise ConfigError([
        f"{', '.join(sizes)}: memory.system={cfg.memory.system!r} would hold "
        f"{max(system.num_logical, system.capacity_tokens)} tokens per device, beyond the "
        f"{MAX_ADDRESSES} int32 addresses; lower the pool sizes (a null pool is "
        f"engine.max_batch x engine.max_context tokens)"])
  return system


MAX_ADDRESSES = 2**31 - 1
"""Tokens one device's pools may hold at most: addresses are int32."""


def check_config(cfg: ExperimentConfig) -> None:
  """Every check that needs the memory system's own sizing (pools against a page or one
  decode step, the TP local buffer, far-tier sizes, hisparse top-k against the model):
  ConfigError before anything is computed. The config layer cannot import the memory
  systems, so ``ula-jax config``, ``run`` and ``sweep`` call this after ``load_config``."""
  sized_system(cfg)


def _gib(n: int) -> str:
  return f"{n / 2**30:.1f} GiB"


KEYS = "index_keys"
"""``pool_bytes_per_device``'s entry for the indexer-key tables (a part of 'device')."""


def pool_bytes_per_device(system: MemorySystem, mesh: Any) -> dict[str, int] | None:
  """Bytes of the pools ``system.init_state(mesh)`` would place on one device, by memory
  kind (``'device'``, ``'pinned_host'``), from their shapes alone: nothing is allocated;
  ``KEYS``: how much of 'device' are indexer-key tables (one key per logical address of
  every layer group, device and host tiers alike). None when the state cannot be traced
  abstractly.

  Pools are made by ``base._make`` (``device_zeros``, ``host_zeros``); under
  ``jax.eval_shape`` the arrays lose their shardings and memory kinds, so each call's
  sharding is recorded as it is made, and each pool is made by XLA's filler, abstractly
  (never on a pinned region)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding

  from ula_jax.memory import base

  out: dict[str, int] = {}
  make = base._make
  geo = system.geo

  def recording(mesh_, shape, dtype, memory_kind, fill, spec, host_alloc):
    del host_alloc
    per_device = NamedSharding(mesh_, spec).shard_shape(tuple(shape))
    nbytes = int(np.prod(per_device, dtype=object)) * np.dtype(dtype).itemsize
    out[memory_kind] = out.get(memory_kind, 0) + nbytes
    if (memory_kind == "device" and len(shape) >= 3 and shape[-1] == geo.index_dim
        and np.dtype(dtype) == np.dtype(geo.index_dtype)):
      # An indexer-key table (rows of index_dim keys), counted in 'device' as well.
      out[KEYS] = out.get(KEYS, 0) + nbytes
    return base._filler(mesh_, shape, dtype, memory_kind, fill, spec)()

  base._make = recording
  try:
    jax.eval_shape(lambda: system.init_state(mesh))
  except Exception:  # a state built outside jax's tracing: no estimate, no check
    return None
  finally:
    base._make = make
  return out


def local_devices(mesh: Any) -> list:
  """This process's devices of ``mesh`` (with jax.distributed the others belong to their
  own processes)."""
  import jax
  return [d for d in mesh.devices.flat if d.process_index == jax.process_index()]


def memory_stats(device: Any) -> dict:
  """``device.memory_stats()``, or {} where the backend has none (CPU)."""
  try:
    return device.memory_stats() or {}
  except Exception:  # some backends raise instead of returning None
    return {}


def check_fits_machine(cfg: ExperimentConfig, mesh: Any, params_bytes: int = 0) -> None:
  """ConfigError when the pools ``cfg`` asks for exceed this machine's memory, checked
  before anything is allocated (an allocation that size would fail deep inside XLA or
  leave the machine swapping): device pools and the model's parameters
  (``params_bytes``, on every device) against one device's memory
  (``memory_stats()['bytes_limit']``), host pools against the host's RAM. On a backend
  without memory statistics (CPU) both live in host RAM, for every local device."""
  system = sized_system(cfg)
  per_device = pool_bytes_per_device(system, mesh)
  if per_device is None:
    return
  device_bytes = per_device.get("device", 0)
  host_bytes = sum(v for k, v in per_device.items() if k not in ("device", KEYS))
  keys = per_device.get(KEYS, 0)
  # The key tables grow with every tier's tokens: name them where they are a good part.
  key_note = (f" ({_gib(keys)} of them indexer keys, one per logical address of every "
              f"layer group{', host tier included' if host_bytes else ''})"
              if keys >= 2**30 and keys * 8 >= device_bytes else "")
  mine = local_devices(mesh)  # the other processes' memory is theirs to check
  if not mine:
    return
  dev, local = mine[0], len(mine)
  limit = memory_stats(dev).get("bytes_limit")
  ram = host_ram()
  pool = f"memory.device_pool={cfg.memory.device_pool!r}"
  # The field that sizes the host-side pool: far_tier's far pool, else memory.host_pool
  # (hisparse: 0 = memory.hisparse.host_to_device_ratio times the device pool).
  if cfg.memory.system == "far_tier":
    host_field, host_value = "memory.far_tier.far_pool", cfg.memory.far_tier.far_pool
  else:
    host_field, host_value = "memory.host_pool", cfg.memory.host_pool
  host = f"{host_field}={host_value!r}"
  key_fix = (f" or {host_field} (its tokens' indexer keys live on the device)"
             if key_note and host_bytes else "")
  params = (f" beside the model's {_gib(params_bytes)} of parameters" if params_bytes
            else "")
  if limit:
    if device_bytes + params_bytes > limit:
      raise ConfigError([
          f"{pool}: memory.system={cfg.memory.system!r} would allocate "
          f"{_gib(device_bytes)} of pools per device{key_note}{params}, more than the "
          f"{_gib(limit)} of {dev.platform} device {dev.id} (mesh.gpu_memory_fraction="
          f"{cfg.mesh.gpu_memory_fraction}); lower memory.device_pool{key_fix} (or "
          f"engine.max_batch / engine.max_context when it is null)"])
    # Host pools are pinned by the backend's allocator, capped below the RAM
    # (core.host_memory): past the cap an allocation fails, at the RAM the process dies.
    pinned = pinned_host_limit() if dev.platform == "gpu" else ram
    if pinned and host_bytes * local > pinned:
      what = (f"the {_gib(pinned)} that may be pinned on this host ({HOST_LIMIT_ENV}; "
              f"the default leaves max({MIN_RESERVE_GIB} GiB, RAM / 8) of its "
              f"{_gib(ram or 0)} of RAM to the process)" if dev.platform == "gpu"
              else f"its {_gib(pinned)} of RAM")
      raise ConfigError([
          f"{host}: memory.system={cfg.memory.system!r} would allocate "
          f"{_gib(host_bytes)} of host pools per device, {_gib(host_bytes * local)} for the "
          f"{local} devices of this host, more than {what}; lower {host_field}"])
  elif ram and (device_bytes + host_bytes + params_bytes) * local > ram:
    # Name the host pool only where the system has one.
    fields = [pool, host] if host_bytes else [pool]
    lower = f"memory.device_pool or {host_field}" if host_bytes else "memory.device_pool"
    raise ConfigError([
        f"{', '.join(fields)}: memory.system={cfg.memory.system!r} would allocate "
        f"{_gib(device_bytes + host_bytes)} of pools per device{key_note}{params}, "
        f"{_gib((device_bytes + host_bytes + params_bytes) * local)} for the {local} "
        f"{dev.platform} devices of this host, more than its {_gib(ram)} of RAM; lower "
        f"{lower} (or engine.max_batch / engine.max_context where a pool is null)"])


__all__ = ["INVALID", "CapacityReport", "KVGeometry", "MemorySystem", "MeshInfo",
           "REGISTRY", "Resolution", "SYSTEM_NAMES", "build_memory_system", "check_config",
           "check_fits_machine", "local_devices", "lookup", "memory_stats", "parse_size",
           "sized_system", "system_class"]
