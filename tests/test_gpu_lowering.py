"""Every memory system's programs lower for a GPU with every Pallas kernel, at decode
batches and prefill chunks that are not powers of 2, read on a CPU.

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


def lowered_steps(monkeypatch, overrides: list[str]) -> dict[str, str]:
  """The text of each of the engine's programs lowered for CUDA: its first decode step,
  a prefill chunk, a release and, with drafts, the verify step."""
  # Pallas outside interpret mode is refused on a CPU platform (a config error for
  # users); lowering for CUDA needs it.
  monkeypatch.setattr(ula_jax.mesh, "check_kernels", lambda *a, **k: None)
  cfg = load_config("experiments/quickstart/config.yaml", [
      "mesh.dp=1", "mesh.tp=1", "engine.progress=false", f"engine.max_context={CONTEXT}",
      *PALLAS, *overrides])
  engine = Engine(cfg, build_mesh(cfg), max_context=CONTEXT)
  kinds = ["speculate" if engine._speculate is not None else "decode", "prefill", "release"]
  kinds += ["verify"] if cfg.speculative.num_draft else []
  return {k: engine.lower_step(k, platforms=("cuda",)).as_text() for k in kinds}


@pytest.mark.parametrize("system, batch", [(s, 36) for s in sorted(SYSTEMS)] + [("ula", 100)])
def test_every_program_lowers_for_a_gpu(system, batch, monkeypatch):
  """A computed prefill chunk of 100 positions too (not a power of 2)."""
  texts = lowered_steps(monkeypatch, [f"memory.system={system}", f"engine.max_batch={batch}",
                                      "engine.prefill_chunk=100", *SYSTEMS[system](batch)])
  step = texts["decode"]
  assert "ula_stacked_matmul" in step and "ula_sparse_mla_attention" in step
  assert "__gpu$xla.gpu.triton" in texts["prefill"]


def test_verify_rows_lower_for_a_gpu(monkeypatch):
  """Speculative decoding's verify step: 12 requests x (1 + 2 drafts) = 36 query rows."""
  texts = lowered_steps(monkeypatch, ["memory.system=ula", "engine.max_batch=12",
                                      "speculative.num_draft=2", *SYSTEMS["ula"](36)])
  assert "ula_stacked_matmul" in texts["verify"]


def test_speculating_and_synthetic_prefill_lower_for_a_gpu(monkeypatch):
  """kernels.fast_path_mode=speculate's step, and a synthetic prefill chunk."""
  texts = lowered_steps(monkeypatch, ["memory.system=ula", "engine.max_batch=36",
                                      "kernels.fast_path_mode=speculate",
                                      "workload.prefill=synthetic", *SYSTEMS["ula"](36)])
  assert "ula_stacked_matmul" in texts["speculate"]


def test_tensor_parallel_step_lowers_for_a_gpu(monkeypatch):
  """`ula` over 2 tp ranks, 36 requests: each rank's products and kernels."""
  texts = lowered_steps(monkeypatch, ["memory.system=ula", "engine.max_batch=36",
                                      *SYSTEMS["ula"](36)] + ["mesh.tp=2"])
  assert "ula_stacked_matmul" in texts["decode"]


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_fp8_entries_lower_for_a_gpu(monkeypatch, attention):
  """FP8 entries (fp8 rows: XLA or Pallas attention, the Pallas fetch, indexer and
  resolve)."""
  texts = lowered_steps(monkeypatch, [
      "memory.system=ula", "engine.max_batch=36", "engine.prefill_chunk=100",
      "model.kv_layout=fp8", "model.kv_lora_rank=128", f"kernels.attention={attention}",
      *SYSTEMS["ula"](36)])
  assert "ula_stacked_matmul" in texts["decode"] and "__gpu$xla.gpu.triton" in texts["prefill"]
  assert ("ula_sparse_mla_attention_fp8" in texts["decode"]) == (attention == "pallas")
