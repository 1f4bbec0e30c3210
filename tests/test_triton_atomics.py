"""What the Pallas resolve's kernels lower to for a GPU, checked on any machine: the
bitmap and counter atomics relaxed, the grid barriers' atomics acquire-release (the
Triton IR of a module lowered for CUDA, ``triton_kernels_ir``), and the stacked metadata
updated in place inside a scan over groups."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from tests.test_resolve_kernel import CASES, system_for
from ula_jax.kernels import triton_ir
from ula_jax.memory.ula import atomics as triton_atomics
from ula_jax.memory.ula.resolve import resolve_group
from ula_jax.memory.ula.resolve import pallas as resolve_pallas
from ula_jax.memory.ula.resolve.pallas import FUSED_CONFIG, ResolveConfig


def lowered_kernels(config: ResolveConfig, programs: int = 8) -> dict[str, tuple[int, int]]:
  """{kernel: (relaxed atomics, acquire-release atomics)} of the Pallas resolve of the
  ``pb_lru`` test case, lowered for CUDA."""
  case = CASES["pb_lru"]
  system = system_for(case)
  sel = jnp.zeros((case.B, case.k), jnp.int32)
  g = resolve_pallas._Geometry.build(
      B=case.B, k=case.k, N=system.num_logical, Sd=system.device_slots, Hr=system.host_rows,
      R=system.buckets, policy="pb_lru", config=config,
      programs=programs if config.fuse else 1)
  # Two groups' metadata, stacked, resolving the second (as inside a decode step).
  meta = jax.tree.map(lambda x: jnp.stack([x, x]), system.init_group_meta())
  text = resolve_pallas._resolve.trace(
      meta, jnp.ones((1,), jnp.int32), sel, sel >= 0, sel[:, 0], sel[:, 0] >= 0, g=g,
      interpret=False).lower(lowering_platforms=("cuda",)).as_text()
  count = lambda ir, sem: len(re.findall(rf"tt.atomic_rmw \w+, {sem},", ir))
  return {name: (count(ir, "relaxed"), count(ir, "acq_rel"))
          for name, ir in triton_ir.triton_kernels_ir(text).items()}


def test_resolve_atomics_are_relaxed_and_barriers_acquire_release():
  # Fails loudly if a jax version no longer lets the relaxed primitive lower.
  assert triton_atomics.RELAXED_AVAILABLE
  fused = lowered_kernels(FUSED_CONFIG)
  assert list(fused) == ["ula_resolve_fused"]
  relaxed, acq_rel = fused["ula_resolve_fused"]
  assert relaxed > 0 and acq_rel == 2 * resolve_pallas._BARRIERS  # arrive + poll each
  staged = lowered_kernels(ResolveConfig())
  assert sorted(staged) == ["ula_resolve_mark", "ula_resolve_place", "ula_resolve_publish",
                            "ula_resolve_round"]
  assert all(r > 0 and a == 0 for r, a in staged.values())


def test_atomic_kind_is_checked():
  with pytest.raises(ValueError, match=r"atomic kind='xor': expected one of \['add', 'and', "
                     r"'or'\]"):
    triton_atomics.atomic("xor", None, (0,), 1)


def _scan_over_groups_ir(fast_path: bool) -> tuple[str, list[str]]:
  """The StableHLO, lowered for CUDA, of a scan over three groups' stacked metadata that
  resolves each group with the four launches, and the stacked leaves' tensor types."""
  case = CASES["pb_lru"]
  system = system_for(case)
  meta = jax.tree.map(lambda x: jnp.stack([x] * 3), system.init_group_meta())
  sel = jnp.zeros((case.B, case.k), jnp.int32)

  def step(meta):
    def body(m, g):
      m, slots, *_ = resolve_group(system, m, sel, sel >= 0, sel[:, 0], sel[:, 0] >= 0,
                                   impl="pallas", interpret=False, fast_path=fast_path,
                                   group=g)
      return m, slots
    return jax.lax.scan(body, meta, jnp.arange(3, dtype=jnp.int32))

  text = jax.jit(step).trace(meta).lower(lowering_platforms=("cuda",)).as_text()
  mlir = {"int32": "i32", "uint32": "ui32"}
  types = {f"tensor<{'x'.join(map(str, x.shape))}x{mlir[x.dtype.name]}>"
           for x in jax.tree.leaves(meta) if x.ndim > 1}
  return text, sorted(types)


def test_stacked_resolve_slices_no_metadata_in_a_decode_scan():
  """Inside the scan over groups, the kernels read and write the stacked metadata in
  place: no dynamic slice takes a group's table, owners or bitmaps out and no dynamic
  update slice writes them back (on the GPU each was a copy, several outside the CUDA
  graphs). The all-hit fast path's conditional still takes the group's slice."""
  def moved(text, types):
    lines = [l for l in text.splitlines()
             if "stablehlo.dynamic_slice" in l or "stablehlo.dynamic_update_slice" in l]
    return [t for t in types if any(t in l for l in lines)]

  text, types = _scan_over_groups_ir(fast_path=False)
  assert len(re.findall(r"stablehlo.custom_call", text)) == 4  # the four launches
  assert not moved(text, types)
  assert moved(*_scan_over_groups_ir(fast_path=True)) == types
