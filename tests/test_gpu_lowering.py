"""Every memory system's decode step lowers for a GPU with every Pallas kernel, at decode
batches that are not powers of 2, read on a CPU.

Pallas's Triton lowering takes only arrays whose sizes are powers of 2, and interpret
mode (how the CPU suite runs the kernels) has no such rule, so a kernel that pads its
rows to anything else passes every CPU test and fails on the GPU at the first such batch
(the layer products padded 36 rows to 48: `hisparse` at its capacity of 36 requests
failed on an H100). Lowering for CUDA runs each kernel's Triton lowering without a GPU.
"""

from __future__ import annotations

import pytest

import ula_jax.mesh
from ula_jax.config import load_config
from ula_jax.engine import Engine
from ula_jax.mesh import build_mesh

CONTEXT = 512
PALLAS = ["kernels.attention=pallas", "kernels.indexer=pallas", "kernels.fetch=pallas",
          "kernels.resolve=pallas", "kernels.projections=pallas", "kernels.interpret=false"]
SYSTEMS = {
    "resident": lambda b: [f"memory.device_pool={b * CONTEXT}", "memory.host_pool=0"],
    "ula": lambda b: [f"memory.device_pool={b * 300}", f"memory.host_pool={b * CONTEXT}"],
    "hisparse": lambda b: [f"memory.host_pool={b * CONTEXT}"],
    "far_tier": lambda b: [f"memory.device_pool={b * CONTEXT}", "memory.host_pool=0",
                           "memory.far_tier.mode=on_demand"],
}


def lowered_step(monkeypatch, overrides: list[str]) -> str:
  """The text of the engine's first decode step lowered for CUDA."""
  # Pallas outside interpret mode is refused on a CPU platform (a config error for
  # users); lowering for CUDA needs it.
  monkeypatch.setattr(ula_jax.mesh, "check_kernels", lambda *a, **k: None)
  cfg = load_config("experiments/quickstart/config.yaml", [
      "mesh.dp=1", "mesh.tp=1", "engine.progress=false", f"engine.max_context={CONTEXT}",
      *PALLAS, *overrides])
  engine = Engine(cfg, build_mesh(cfg), max_context=CONTEXT)
  step = engine._speculate if engine._speculate is not None else engine._decode
  return step.trace(engine.params, engine.carry, engine.idle_decode_inputs()).lower(
      lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("system", sorted(SYSTEMS))
@pytest.mark.parametrize("batch", [3, 36])
def test_decode_step_lowers_for_a_gpu(system, batch, monkeypatch):
  text = lowered_step(monkeypatch, [f"memory.system={system}",
                                    f"engine.max_batch={batch}", *SYSTEMS[system](batch)])
  assert "ula_stacked_matmul" in text and "__gpu$xla.gpu.triton" in text


def test_verify_rows_lower_for_a_gpu(monkeypatch):
  """Speculative decoding's verify step: 12 requests x (1 + 2 drafts) = 36 query rows."""
  text = lowered_step(monkeypatch, ["memory.system=ula", "engine.max_batch=12",
                                    "speculative.num_draft=2", *SYSTEMS["ula"](36)])
  assert "ula_stacked_matmul" in text


def test_tensor_parallel_step_lowers_for_a_gpu(monkeypatch):
  """`ula` over 2 tp ranks, 36 requests: each rank's products and kernels."""
  text = lowered_step(monkeypatch, ["memory.system=ula", "engine.max_batch=36",
                                    *SYSTEMS["ula"](36)] + ["mesh.tp=2"])
  assert "ula_stacked_matmul" in text
