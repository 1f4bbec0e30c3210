"""Where an engine's pools are made: before the parameters, and a device that cannot
allocate them is a config error naming the pool fields; so is a step whose working memory
does not fit beside them."""

from __future__ import annotations

import jax
import pytest

from ula_jax.config import ConfigError, load_config
from ula_jax.engine import Engine, resolve_max_context
from ula_jax.memory.ula.dp import Ula
from ula_jax.models import transformer as tfm
from tests.engine_util import BASE, DENSE, make_requests, mesh_for

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


_PARAMS_OOM = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.50GiB with "
               "allocator GPU_0_bfc on device 0.\nCurrent allocation summary follows.")


@pytest.mark.parametrize("where", ["drawn", "waited_for"])
def test_parameters_the_device_cannot_hold_beside_the_pools_are_a_config_error(
    monkeypatch, where):
  # Drawing the parameters is dispatched ahead: the engine waits for them, so a device
  # out of memory while they are drawn or once they run is reported there, naming the
  # pools, not at the first decode step that reads them.
  from flax import nnx
  if where == "drawn":
    model, calls = tfm.Transformer.__init__, []

    def draw(self, *args, **kwargs):  # the first (the engine's) draw fails
      calls.append(1)
      if len(calls) == 1:
        raise jax.errors.JaxRuntimeError(_PARAMS_OOM)
      model(self, *args, **kwargs)

    monkeypatch.setattr(tfm.Transformer, "__init__", draw)
  else:
    ready = jax.block_until_ready

    def block(tree):
      if isinstance(tree, nnx.State) and "embed" in tree:
        raise jax.errors.JaxRuntimeError(_PARAMS_OOM)
      return ready(tree)

    monkeypatch.setattr(jax, "block_until_ready", block)
  with pytest.raises(ConfigError, match=r"memory\.device_pool=64, memory\.host_pool=256: "
                     r"model='tiny''s parameters \(\d+\.\d\d GiB\) did not fit beside "
                     r"memory\.system='ula''s pools \(RESOURCE_EXHAUSTED: Out of memory "
                     r"while trying to allocate 4\.50GiB[^\n]*\); lower memory\.device_pool"):
    _engine(ULA)


def test_other_runtime_errors_pass_through(monkeypatch):
  def broken(self, mesh):
    raise jax.errors.JaxRuntimeError("INTERNAL: something else")

  monkeypatch.setattr(Ula, "init_state", broken)
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
    _engine(ULA)


STEP_OOM = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.50GiB with "
            "allocator GPU_0_bfc on device 0. [tf-allocator-allocation-error=''] "
            "[executable_name='jit_prefill']\nCurrent allocation summary follows.")


class _FailingStep:
  """A jitted step whose every call fails with ``error``; it lowers as ``step`` does."""

  def __init__(self, step, error):
    self.lower, self._error = step.lower, error

  def __call__(self, *args, **kwargs):
    raise jax.errors.JaxRuntimeError(self._error)


def test_a_step_the_device_has_no_memory_for_is_a_config_error(monkeypatch):
  """Pools and parameters fit, a step's working memory does not: the run stops with a
  ConfigError naming the step, what it asked for, the device's use, and the fields that
  size them (a GPU: the device's memory statistics are given here)."""
  from ula_jax.engine import engine as engine_module

  engine = _engine(ULA)
  prefill = engine._prefill
  engine._prefill = _FailingStep(prefill, STEP_OOM)
  monkeypatch.setattr(engine_module, "memory_stats",
                      lambda device: {"bytes_in_use": 75 * 2**30, "bytes_limit": 79 * 2**30})
  requests = make_requests(num=1, seed=0, prompt=(5, 9), output=(2, 3))
  with pytest.raises(ConfigError, match=(
      r"memory\.device_pool=64: the prefill step ran out of device memory \(it asked for "
      r"4\.50GiB more; 75\.00 of 79\.00 GiB of the device were in use; before the first "
      r"prefill the decode step's working memory was 0\.00 GiB with 4\.00 GiB free\): the "
      r"pools and the parameters fit, the step's working memory did not; lower "
      r"memory\.device_pool \(or "
      r"memory\.host_pool=256, whose tokens' indexer keys live on the device\) by at least "
      r"that much, or engine\.max_batch=1")) as e:
    engine.run(list(requests))
  assert "allocation summary" not in str(e.value)

  engine._prefill = _FailingStep(prefill, "RESOURCE_EXHAUSTED: out of memory")  # no names given
  with pytest.raises(ConfigError, match=r"memory\.device_pool=64: a step ran out of device "
                     r"memory \(RESOURCE_EXHAUSTED: out of memory; 75\.00 of 79\.00 GiB"):
    engine.run(list(requests))

  engine._prefill = _FailingStep(prefill, "INTERNAL: something else")
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
    engine.run(list(requests))


def test_a_decode_step_that_cannot_fit_stops_the_run_before_any_prefill(monkeypatch):
  """The first decode program is compiled before anything is served and its working
  memory set against the device's free bytes: too little is a ConfigError naming the step,
  what it needs and the fields that size it, before a prompt is prefilled; enough, and
  the first decode step runs the program compiled for the check (nothing compiles twice).
  The device's memory statistics are given here (a GPU's); CPU has none and skips it."""
  from ula_jax.engine import engine as engine_module

  # Four rows and chunks of 4 positions: the decode step's working memory is the larger
  # (with one row and the default chunk the prefill's is, below).
  engine = _engine(ULA + ["engine.prefill_chunk=4", "engine.max_batch=4"])
  need = sum(engine.working_memory("decode"))
  assert need > sum(engine.working_memory("prefill")) > 0
  limit = 79 * 2**30
  monkeypatch.setattr(engine_module, "memory_stats",
                      lambda device: {"bytes_in_use": limit - need + 1, "bytes_limit": limit})
  requests = make_requests(num=1, seed=0, prompt=(5, 9), output=(2, 3))
  with pytest.raises(ConfigError, match=(
      r"memory\.device_pool=64: the decode step needs \d+\.\d\d [MG]iB of working memory "
      r"\(\d+\.\d\d [MG]iB of temporaries, \d+\.\d\d [MG]iB of new outputs\) beside the "
      r"pools, parameters and state, and device \d+ has \d+\.\d\d [MG]iB free \(79\.00 of "
      r"79\.00 GiB in use\); lower memory\.device_pool by at least 0\.00 MiB \(or "
      r"memory\.host_pool=256, whose tokens' indexer keys live on the device\), or "
      r"engine\.max_batch=4, whose rows")):
    engine.run(list(requests))
  assert not hasattr(engine, "run_state")  # stopped before its requests were taken in

  # Another step (five rows, not four), so that nothing of the first engine's is reused.
  engine = _engine(ULA + ["engine.prefill_chunk=4", "engine.max_batch=5"])
  monkeypatch.setattr(engine_module, "memory_stats",
                      lambda device: {"bytes_in_use": 0, "bytes_limit": limit})
  result = engine.run(list(requests))
  assert [r.status for r in result.requests] == ["finished"]
  log = engine.compile_log
  assert (log.programs["decode"], log.cached["decode"]) == (1, 0), (log.programs, log.cached)
  checked = result.summary["step_memory"]  # what the check measured, in the run's summary
  assert (checked["step"], checked["free_bytes"], checked["limit_bytes"]) == ("decode", limit,
                                                                               limit)
  assert checked["need_bytes"] == checked["temp_bytes"] + checked["new_output_bytes"] > 0
  assert checked["in_use_at_first_decode_bytes"] == 0  # as given
  assert checked["prefill_temp_bytes"] > 0
  # The prefill's program is the first engine's (four rows or five): compiled there, and here
  # read from the persistent cache or reused, at most once.
  assert log.programs["prefill"] + log.cached["prefill"] <= 1, (log.programs, log.cached)


def test_a_prefill_chunk_that_cannot_fit_stops_the_run_before_any_prefill(monkeypatch):
  """The prefill chunk's program is checked as the decode step's is: with room for the
  decode step's working memory and not for a chunk's, the ConfigError names the prefill
  step and the fields that size a chunk (a GLM-5-geometry synthetic chunk on an H100 with
  a 52 GiB pool: 2.95 GiB asked with 2.38 GiB free; RESULTS.md)."""
  from ula_jax.engine import engine as engine_module

  engine = _engine(ULA)
  decode, prefill = (sum(engine.working_memory(step)) for step in ("decode", "prefill"))
  assert prefill > decode > 0, (prefill, decode)  # a chunk of 8 positions against one row
  limit = 79 * 2**30
  monkeypatch.setattr(engine_module, "memory_stats", lambda device: {
      "bytes_in_use": limit - prefill + 1, "bytes_limit": limit})
  requests = make_requests(num=1, seed=0, prompt=(5, 9), output=(2, 3))
  with pytest.raises(ConfigError, match=(
      r"memory\.device_pool=64: the prefill step needs \d+\.\d\d [MG]iB of working memory "
      r"\(\d+\.\d\d [MG]iB of temporaries, \d+\.\d\d [MG]iB of new outputs\) beside the "
      r"pools, parameters and state, .*; lower memory\.device_pool by at least 0\.00 MiB "
      r"\(or memory\.host_pool=256, whose tokens' indexer keys live on the device\), or "
      r"engine\.prefill_chunk=\d+ or engine\.prefill_scratch=")):
    engine.run(list(requests))
  assert not hasattr(engine, "run_state")
  assert engine.step_memory["prefill_need_bytes"] == prefill
  assert engine.step_memory["need_bytes"] == decode


def test_no_decode_program_is_compiled_ahead_without_memory_statistics():
  """CPU reports no memory statistics: nothing is compiled before the run's first step."""
  engine = _engine(ULA)
  engine.check_step_memory()
  assert engine.compile_log.programs["decode"] == 0


def test_a_config_error_of_the_engine_reaches_the_user_once(monkeypatch, tmp_path):
  """A run whose engine refuses its config (pools, parameters, step memory) reports that
  error as it is: one 'invalid config:', not a second wrapped around the first."""
  import ula_jax.engine
  from ula_jax.run import run_experiment

  def refuse(cfg, mesh, **kwargs):
    raise ConfigError(["memory.device_pool=64: refused"])

  monkeypatch.setattr(ula_jax.engine, "Engine", refuse)
  cfg = load_config(BASE, ["model.preset=tiny", "engine.progress=false"] + ULA)
  with pytest.raises(ConfigError) as e:
    run_experiment(cfg, tmp_path / "run", progress=False, mesh=mesh_for(1), show=False)
  assert str(e.value) == "invalid config: memory.device_pool=64: refused"
