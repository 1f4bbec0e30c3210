"""What the Pallas resolve's kernels lower to for a GPU, checked on any machine: the
bitmap and counter atomics relaxed, the grid barriers' atomics acquire-release (the
Triton IR of a module lowered for CUDA, ``triton_kernels_ir``)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from tests.test_resolve_kernel import CASES, system_for
from ula_jax.kernels import triton_ir
from ula_jax.memory.ula import atomics as triton_atomics
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
