"""The engine's compiled decode step never copies a pool (GPU).

The layer stack is a loop over layer groups with the pools in its carry, so one copy
would be paid per group and step. ``ula``'s ``move_group`` reads a pool (the victims' rows, the misses' host rows) and
writes the same pool in place (the fetched rows, the written-back victims). Unless each
write is ordered after the reads, XLA copies the whole pool per layer and step to let
them run in either order: on an H200 with a 128K-token host pool that was 70 ms of a
4 ms step. The compiled HLO must hold no instruction that materialises a device or host
pool (``kernels.fetch.hlo.pool_materializations``). On CPU the layout changes of
``shard_map`` copy the pools for other reasons, so this runs on a GPU only.
"""

from __future__ import annotations

import re

import pytest

from ula_jax.config import load_config
from ula_jax.engine import Engine
from ula_jax.kernels.fetch.hlo import pool_materializations
from ula_jax.mesh import build_mesh


@pytest.mark.gpu
@pytest.mark.parametrize("fetch", ["pallas", "ffi"])
def test_ula_decode_step_copies_no_pool(fetch):
  # Pool sizes no other array has: 1216 device slots, 4160 host slots.
  cfg = load_config("experiments/quickstart/config.yaml", [
      "model=tiny", "mesh.platform=gpu", "mesh.dp=1", "mesh.tp=1", "engine.max_batch=4",
      "engine.progress=false", "memory.system=ula", "memory.device_pool=1216",
      "memory.host_pool=4160", f"kernels.fetch={fetch}", "kernels.resolve=pallas"])
  engine = Engine(cfg, build_mesh(cfg), max_context=512)
  text = engine.decode_hlo()
  # Stacked pools: every layer's rows in one array per tier ([L * S, W], 4 layers).
  shapes = {x.shape[1:] for x in (engine.state.dev_pool, engine.state.host_pool)}
  assert shapes == {(4 * 1216, 48), (4 * 4160, 48)}
  found = [line for s in shapes for line in pool_materializations(text, s)]
  assert not found, found[:4]
  # Nor does it gather a whole worst-case plan list of rows (B * (k + 1) per layer of a
  # group): the Pallas stage touches the step's victims alone. (kernels.fetch=xla's
  # reference does gather them: 6 such gathers on a CPU.)
  M = cfg.engine.max_batch * (cfg.model.index_topk + 1)
  lists = re.compile(rf"\[({M}|{M * cfg.model.index_share})(,1)?,48\]\S*\s+gather\(")
  gathers = [line for line in text.splitlines() if lists.search(line)]
  assert not gathers, gathers[:4]


# Every program that carries the state, for each system with a host or far pool: a pool
# copied by a prefill chunk costs the pool's size in device memory (a 40 GiB host pool
# could not be prefilled next to a 60 GiB device pool on one H200).
_POOLED = {
    "ula": ["memory.system=ula", "memory.device_pool=1216", "memory.host_pool=4160",
            "kernels.resolve=pallas"],
    "hisparse": ["memory.system=hisparse", "memory.hisparse.device_buffer_size=28",
                 "memory.hisparse.host_to_device_ratio=4"],
    "far_tier": ["memory.system=far_tier"],
}


@pytest.mark.gpu
@pytest.mark.parametrize("system", sorted(_POOLED))
@pytest.mark.parametrize("program", ["prefill_compute", "prefill_synthetic", "verify",
                                     "release"])
def test_programs_copy_no_pool(system, program):
  prefill = "synthetic" if program == "prefill_synthetic" else "compute"
  cfg = load_config("experiments/quickstart/config.yaml", [
      "model=tiny", "mesh.platform=gpu", "mesh.dp=1", "mesh.tp=1", "engine.max_batch=4",
      "engine.progress=false", "kernels.fetch=pallas", f"workload.prefill={prefill}",
      "speculative.num_draft=2"] + _POOLED[system])
  engine = Engine(cfg, build_mesh(cfg), max_context=512)
  text = engine.lower_step(program.split("_")[0]).compile().as_text()
  import jax
  # The pools: every state leaf of more than 64K elements (pinned-host or device).
  shapes = {x.shape[1:] for x in jax.tree.leaves(engine.state) if x.size >= 1 << 16}
  assert shapes, "no pool found in the state"
  found = [line for s in shapes for line in pool_materializations(text, s)]
  assert not found, found[:4]
