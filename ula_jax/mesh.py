"""The ``('dp', 'tp')`` device mesh of an experiment.

``configure_platform`` must run before jax starts its backend (before the first array
is created): on CPU it asks jax for as many simulated devices as the mesh needs.
``build_mesh`` then lays the first ``dp * tp`` devices out as the mesh.
"""

from __future__ import annotations

import os
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from ula_jax.config import ConfigError, ExperimentConfig, KernelsConfig, check_devices
from ula_jax.core.compilation import enable_persistent_cache
from ula_jax.core.host_memory import HOST_LIMIT_ENV, default_pinned_limit_gib, host_ram
from ula_jax.kernels.auto import Device, LaunchShape, resolve_kernels

AXES = ("dp", "tp")
_JAX_PLATFORM = {"cpu": "cpu", "gpu": "cuda"}
_DETERMINISTIC_GPU_FLAGS = (
    "--xla_gpu_deterministic_ops=true", "--xla_gpu_autotune_level=0",
    # Every bf16 rounding the program states happens, fused or not, and every GEMM is a
    # library call picked by its shape: neither then depends on what surrounds the op.
    "--xla_allow_excess_precision=false", "--xla_gpu_enable_triton_gemm=false")
MEM_FRACTION_ENV = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
"""The GPU allocator's share of device memory (the second is the older name)."""
MAX_CPU_DEVICES = 1024
"""Simulated CPU devices at most (``jax_num_cpu_devices``): XLA starts every one when the
backend starts, so a count like 100000 would hang instead of failing."""


def configure_platform(cfg: ExperimentConfig, num_devices: int | None = None) -> None:
  """Selects the backend and the simulated CPU device count (``num_devices``, default
  ``mesh.dp * mesh.tp``; a sweep passes the largest mesh it will build).

  Once the backend has started these settings are fixed; then nothing changes here and
  ``build_mesh`` reports a mesh that does not fit the devices that exist.
  """
  n = num_devices or cfg.mesh.num_devices
  platform = cfg.mesh.platform
  if platform == "cpu" and n > MAX_CPU_DEVICES:
    # XLA creates every simulated CPU device up front, each with its own threads: a
    # count this large never finishes starting the backend.
    raise ConfigError([f"mesh.dp*mesh.tp = {cfg.mesh.dp}*{cfg.mesh.tp} = {n} devices with "
                       f"mesh.platform=cpu: at most {MAX_CPU_DEVICES} simulated CPU devices; "
                       f"lower mesh.dp or mesh.tp"])
  if cfg.kernels.deterministic and platform in ("auto", "gpu"):
    # Read when the GPU backend starts. Autotuning may pick different GEMM algorithms
    # for the same shape in two programs (resident's and ula's steps), atomics make
    # reductions order-dependent, and fusion decides whether a bf16 rounding happens and
    # whether a GEMM is a generated kernel: each breaks token-for-token comparisons.
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in _DETERMINISTIC_GPU_FLAGS:
      if flag.split("=")[0] not in flags:
        flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags
  fraction = cfg.mesh.gpu_memory_fraction
  if (platform in ("auto", "gpu") and fraction is not None
      and not any(os.environ.get(v) for v in MEM_FRACTION_ENV)):
    # Read when the GPU backend starts: the allocator's limit, a share of the device's
    # memory (jax's default, 0.75, also caps growth without preallocation).
    os.environ[MEM_FRACTION_ENV[0]] = str(fraction)
  if platform in ("auto", "gpu") and HOST_LIMIT_ENV not in os.environ:
    # Read when the GPU backend starts: its pinned host allocator (host pools) stops at
    # 64 GiB unless told otherwise. Raised to the RAM less the process's reserve
    # (core.host_memory); check_fits_machine holds host pools to it.
    ram = host_ram()
    if ram:
      os.environ[HOST_LIMIT_ENV] = str(default_pinned_limit_gib(ram))
  try:
    if platform != "auto" and jax.config.jax_platforms != _JAX_PLATFORM[platform]:
      jax.config.update("jax_platforms", _JAX_PLATFORM[platform])
    if platform in ("auto", "cpu") and jax.config.jax_num_cpu_devices < n <= MAX_CPU_DEVICES:
      # With 'auto' a mesh beyond MAX_CPU_DEVICES can only be real devices; asking for that
      # many CPU devices would hang, and build_mesh reports the devices that do exist.
      # Only the CPU backend reads it, so it is harmless when 'auto' picks a GPU.
      jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:
    pass  # the backend has started: the devices are what they are
  if cfg.engine.compilation_cache:
    enable_persistent_cache(cfg.engine.compilation_cache_dir)


def mesh_devices(cfg: ExperimentConfig) -> list:
  """The devices of ``mesh.platform`` that exist (ConfigError when it has none)."""
  platform = cfg.mesh.platform
  if platform == "auto":
    return jax.devices()
  try:
    return jax.devices(platform)
  except (RuntimeError, AssertionError) as e:
    # With jax_platforms naming only a backend that cannot start, jax fails an internal
    # assertion rather than raising RuntimeError.
    why = str(e).strip().splitlines()[0] if str(e).strip() else "no such backend"
    raise ConfigError([f"mesh.platform={platform!r}: jax has no {platform} backend here "
                       f"({why}); use mesh.platform=auto or cpu"]) from None


def check_kernels(cfg: ExperimentConfig, platform: str) -> None:
  """Pallas kernels compile only on GPU; on CPU they need interpret mode, and the Mosaic
  GPU attention (which has none) cannot run."""
  k = cfg.kernels
  if platform != "gpu" and k.attention == "mosaic":
    raise ConfigError([f"kernels.attention=mosaic on {platform}: the Mosaic GPU kernel runs "
                       f"on Hopper GPUs only; use kernels.attention=pallas (interpret mode "
                       f"off the GPU) or xla"])
  if platform == "cpu" and k.uses_pallas and k.interpret is False:
    names = [f"kernels.{f}={getattr(k, f)}" for f in ("attention", "fetch", "resolve")
             if getattr(k, f).startswith("pallas")]
    raise ConfigError([f"kernels.interpret=false with {', '.join(names)} on CPU: Pallas "
                       f"runs on CPU only in interpret mode; set kernels.interpret=null "
                       f"(automatic) or true"])


def interpret_kernels(cfg: ExperimentConfig, platform: str) -> bool:
  """Whether Pallas kernels run in interpret mode (``kernels.interpret``, None = on CPU)."""
  if cfg.kernels.interpret is not None:
    return cfg.kernels.interpret
  return platform == "cpu"


def launch_shape(cfg: ExperimentConfig, *, rows: int | None = None,
                 tp: int | None = None, wide_byte_pool: bool = False) -> LaunchShape:
  """The launch shapes ``kernels.*=auto`` is decided for (``kernels.auto.LaunchShape``):
  ``rows`` query rows per attention launch (default: a decode step's, ``engine.max_batch``
  x (1 + ``speculative.num_draft``)) and heads split over ``tp`` ranks (default
  ``mesh.tp``); ``wide_byte_pool``: a one-byte state array holds 2-4 GiB on a device."""
  m, wl = cfg.model, cfg.workload
  computed_prefill = wl.prefill == "compute" and wl.kind != "trace"
  return LaunchShape(
      rows=rows or cfg.engine.max_batch * cfg.speculative.rows,
      heads=m.num_heads // (tp or cfg.mesh.tp), latent=m.kv_lora_rank,
      rope=m.qk_rope_head_dim, top_k=cfg.top_k, kv_dtype=m.kv_dtype, kv_layout=m.kv_layout,
      prefill_heads=m.num_heads if computed_prefill else None, index_dim=m.index_head_dim,
      policy=cfg.memory.policy, buckets=cfg.memory.pb_lru_buckets,
      row_bytes=m.entry_layout.row_bytes,
      wide_byte_pool=wide_byte_pool)


def auto_kernels(cfg: ExperimentConfig, device: Any, *, rows: int | None = None,
                 tp: int | None = None, wide_byte_pool: bool = False) -> KernelsConfig:
  """``cfg.kernels`` with ``auto`` resolved for jax device ``device`` and the config's
  launch shapes (``launch_shape``; ``kernels.auto``): what the engine and the benchmarks
  build with."""
  return resolve_kernels(cfg.kernels, Device.of(device),
                         launch_shape(cfg, rows=rows, tp=tp, wide_byte_pool=wide_byte_pool))


def build_mesh(cfg: ExperimentConfig) -> Mesh:
  """A mesh with axes ``('dp', 'tp')`` of shape ``(mesh.dp, mesh.tp)`` over the first
  ``dp * tp`` devices. Axis types are Auto: memory systems and the engine place arrays
  with explicit shardings and compute per device inside ``shard_map``."""
  devices = mesh_devices(cfg)
  platform = devices[0].platform
  check_devices(cfg, len(devices), platform)
  check_kernels(cfg, platform)
  n = cfg.mesh.num_devices
  return jax.make_mesh((cfg.mesh.dp, cfg.mesh.tp), AXES,
                       axis_types=(AxisType.Auto,) * len(AXES), devices=devices[:n])
