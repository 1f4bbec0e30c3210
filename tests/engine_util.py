"""Shared helpers for end-to-end engine tests (tiny model, simulated CPU devices)."""

from __future__ import annotations

import jax
import numpy as np

from ula_jax.config import load_config
from ula_jax.engine import Engine, Request, resolve_max_context

BASE = "experiments/quickstart/config.yaml"


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
