"""Shared helpers for end-to-end engine tests (tiny model, simulated CPU devices)."""

from __future__ import annotations

import jax
import numpy as np

from ula_jax.config import load_config
from ula_jax.engine import Engine, Request, resolve_max_context

BASE = "experiments/quickstart/config.yaml"

TOP_K = 8  # the tiny preset's index_topk
ROWS = 2  # decode rows per dp rank in the tight-pool runs (engine.max_batch)
TIGHT_SYSTEMS = {
    "resident": [],
    # a device pool of 1.5 selections per row: most decode steps miss and evict
    "ula": ["memory.system=ula", f"memory.device_pool={int(1.5 * TOP_K * ROWS)}",
            "memory.host_pool=1024"],
    # a buffer of one selection per (request, group)
    "hisparse": ["memory.system=hisparse", f"memory.hisparse.device_buffer_size={TOP_K}",
                 "memory.hisparse.host_to_device_ratio=32"],
    "far_tier": ["memory.system=far_tier"],
}
"""Overrides per memory system for tiny-model runs of ``ROWS`` rows whose decode steps
miss and evict (the tests that compare every system's tokens)."""
DENSE = ["model.num_dense_layers=4"]
"""The tiny preset with a dense MLP in each of its four layers (the same two layer groups
and attention): for runs that compare memory systems, kernels or engine modes, whose tokens
do not depend on the kind of MLP; the MoE layers' code is about a quarter of each step's
compile time. The model's own tests (test_model.py, test_deep_model.py) run the MoE."""


def make_requests(num: int, seed: int, prompt: tuple[int, int], output: tuple[int, int],
                  vocab: int = 256) -> tuple[Request, ...]:
  rng = np.random.default_rng(seed)
  return tuple(
      Request(id=f"r{i}", prompt=rng.integers(0, vocab, rng.integers(*prompt)).astype(np.int32),
              max_new_tokens=int(rng.integers(*output)))
      for i in range(num))


def mesh_for(dp: int, tp: int = 1):
  devices = np.asarray(jax.devices()[: dp * tp]).reshape(dp, tp)
  return jax.sharding.Mesh(devices, ("dp", "tp"))


def run_engine(overrides: list[str], requests, base: str = BASE, on_step=None):
  cfg = load_config(base, ["model.preset=tiny", "engine.progress=false"] + list(overrides))
  mesh = mesh_for(cfg.mesh.dp, cfg.mesh.tp)
  engine = Engine(cfg, mesh, max_context=resolve_max_context(cfg))
  return engine.run(list(requests), on_step=on_step)
