"""Pieces several experiments use: the systems at equal budgets (``bench.serving``'s
setups), base configs, and traces that fill a system to its capacity."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import Field, field_validator

from ula_jax.experiments.base import EXPERIMENTS_DIR, Params, cache_overrides

BASE_CONFIG = str(EXPERIMENTS_DIR / "quickstart" / "config.yaml")
"""The experiment file the engine runs start from (``bench serving``'s default); the
parameters' ``model`` and ``overrides`` change it."""

SystemName = Literal["resident_tp", "resident_dp", "hisparse", "ula_dp", "ula_tp"]
LABELS = {"resident_tp": "resident TP", "resident_dp": "resident DP",
          "hisparse": "HiSparse", "ula_dp": "ula DP", "ula_tp": "ula TP"}


class ServingParams(Params):
  """Systems at equal device and host budgets per device (``bench serving``'s setups)."""

  platform: Literal["cpu", "gpu"] = Field(
      "cpu", description="cpu: simulated devices; gpu: the host's GPUs")
  devices: int = Field(8, ge=1, description="devices G every system runs on")
  model: str = Field("tiny", description="model block (configs/model/NAME.yaml)")
  overrides: list[str] = Field(
      default_factory=list, description="more config overrides of every run (a.b=v), e.g. "
      "kernels.fetch=pallas")
  systems: list[SystemName] = Field(
      default_factory=lambda: ["resident_tp", "resident_dp", "hisparse", "ula_dp", "ula_tp"],
      description="systems: resident_tp, resident_dp, hisparse, ula_dp, ula_tp")
  device_budget: int | str = Field(
      4096, description="KV per device: tokens, or bytes with a unit ('60GiB')")
  host_budget: int | str = Field(8192, description="host KV per device, likewise")
  hisparse_buffer: int | None = Field(
      None, ge=1, description="HiSparse device_buffer_size; None = 2 x top-k")
  page_size: int = Field(64, ge=1, description="engine.page_size")
  max_rows: int = Field(128, ge=1, description="decode rows per dp rank, at most")

  @field_validator("systems")
  @classmethod
  def _systems(cls, v: list[str]) -> list[str]:
    if not v or len(set(v)) != len(v):
      raise ValueError(f"systems={v}: expected a non-empty list without repeats")
    return v

  def base_overrides(self) -> list[str]:
    return [f"model={self.model}", f"mesh.platform={self.platform}",
            f"engine.page_size={self.page_size}", "engine.progress=false",
            *cache_overrides(), *self.overrides]


def serving_args(p: ServingParams, *, context: int, **more: Any) -> argparse.Namespace:
  """The arguments ``bench.serving``'s functions read, from the parameters."""
  ns = argparse.Namespace(
      config=BASE_CONFIG, overrides=p.base_overrides(), context=context,
      device_budget=str(p.device_budget), host_budget=str(p.host_budget),
      max_rows=p.max_rows, devices=p.devices, system_list=list(p.systems),
      hisparse_buffer=p.hisparse_buffer, prefill_chunk=None, decode_steps=8, seed=0,
      batch_list=[])
  for k, v in more.items():
    setattr(ns, k, v)
  return ns


_POINTS: dict[tuple, dict] = {}


def measure_point(args: argparse.Namespace, s, batch: int) -> dict:
  """``bench.serving.run_point`` (one engine of ``batch / dp`` rows per dp rank serving
  ``batch`` requests: its median full-batch decode step), measured once per process for
  the same config, system and batch: throughput and latency share their points."""
  from ula_jax.bench.serving import run_point

  key = (args.config, tuple(args.overrides), args.context, args.prefill_chunk,
         args.decode_steps, args.seed, s, batch)
  if key not in _POINTS:
    _POINTS[key] = run_point(args, s, batch)
  return dict(_POINTS[key])


def base_config(p: ServingParams, extra: Sequence[str] = ()):
  from ula_jax.config import load_config
  return load_config(BASE_CONFIG, p.base_overrides() + list(extra))


def setups(p: ServingParams, top_k: int) -> dict:
  """Each system's ``bench.serving.Setup`` (mesh and overrides) on ``p.devices``."""
  from ula_jax.bench.serving import setup
  buf = p.hisparse_buffer or 2 * top_k
  return {name: setup(name, p.devices, device_budget=str(p.device_budget),
                      host_budget=str(p.host_budget), hisparse_buffer=buf)
          for name in p.systems}


def fill_report(p: ServingParams, s, *, context: int, rows: int, requests_per_rank: int,
                seed: int = 0) -> dict:
  """One dp rank of system ``s`` holding ``requests_per_rank`` requests of ``context``
  tokens each (``context - 2`` prompt tokens and two decode steps), replayed from a
  synthetic trace through the system (NumPy models; ula TP through its jax
  transitions): the capacity report at the peak (after the first decode step: prompts
  and one new token each), as a run's ``capacity``."""
  from ula_jax.bench.serving import _load
  from ula_jax.memory.traces import SelectionTrace
  from ula_jax.memory.traces.generate import Locality, generate
  from ula_jax.memory.traces.replay import build_rank_system, replay

  args = serving_args(p, context=context)
  cfg = _load(args, s, rows)
  geo = cfg.model.kv_geometry()
  system = build_rank_system(cfg.memory, geo, tp=s.tp, dp=s.dp, max_batch=rows,
                             page_size=p.page_size, max_context=context)
  with tempfile.TemporaryDirectory(prefix="ula-jax-fill-") as tmp:
    path = generate(Path(tmp) / "fill.npz", geo, requests=requests_per_rank, steps=(2, 2),
                    context=(context - 2, context - 2), locality=Locality(),
                    max_batch=rows, page_size=p.page_size, prefill_chunk=context, seed=seed)
    trace = SelectionTrace.load(path)
    result = replay(trace, system, engine="fast", report_every=1, validate=False)
  report = result.peak_report()
  out = report.as_dict()
  out.update(groups=geo.num_groups, engine=result.engine, replay_s=result.seconds,
             requests_per_rank=requests_per_rank, context=context)
  return out
