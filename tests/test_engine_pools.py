"""Where an engine's pools are made: before the parameters, and a device that cannot
allocate them is a config error naming the pool fields."""

from __future__ import annotations

import jax
import pytest

from ula_jax.config import ConfigError, load_config
from ula_jax.engine import Engine, resolve_max_context
from ula_jax.memory.ula.dp import Ula
from ula_jax.models import transformer as tfm
from tests.engine_util import BASE, DENSE, mesh_for

ULA = DENSE + ["memory.system=ula", "memory.device_pool=64", "memory.host_pool=256",
               "mesh.dp=1", "engine.max_batch=1"]


def _engine(overrides):
  cfg = load_config(BASE, ["model.preset=tiny", "engine.progress=false"] + overrides)
  return Engine(cfg, mesh_for(1), max_context=resolve_max_context(cfg))


def test_pools_are_allocated_before_the_parameters(monkeypatch):
  order = []
  init_state, model = Ula.init_state, tfm.Transformer.__init__

  def pools(self, mesh):
    order.append("pools")
    return init_state(self, mesh)

  def params(self, *args, **kwargs):
    order.append("params")
    return model(self, *args, **kwargs)

  monkeypatch.setattr(Ula, "init_state", pools)
  monkeypatch.setattr(tfm.Transformer, "__init__", params)
  engine = _engine(ULA)
  assert order == ["pools", "params"]
  assert engine.pools_time_s >= 0


def test_a_pool_the_device_cannot_allocate_is_a_config_error(monkeypatch):
  def out_of_memory(self, mesh):
    raise jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 48.00GiB with "
        "allocator GPU_0_bfc on device 0.\nCurrent allocation summary follows.")

  monkeypatch.setattr(Ula, "init_state", out_of_memory)
  with pytest.raises(ConfigError, match=r"memory\.device_pool=64, memory\.host_pool=256: "
                     r"allocating memory\.system='ula''s pools failed \(RESOURCE_EXHAUSTED: "
                     r"Out of memory while trying to allocate 48\.00GiB[^\n]*\); lower "
                     r"memory\.device_pool or memory\.host_pool") as e:
    _engine(ULA)
  assert "allocation summary" not in str(e.value)  # the first line only


def test_other_runtime_errors_pass_through(monkeypatch):
  def broken(self, mesh):
    raise jax.errors.JaxRuntimeError("INTERNAL: something else")

  monkeypatch.setattr(Ula, "init_state", broken)
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
    _engine(ULA)
