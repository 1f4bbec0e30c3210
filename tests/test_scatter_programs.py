"""No engine program holds a scatter that XLA's deterministic rewrite can get wrong.

On a GPU with ``--xla_gpu_deterministic_ops`` XLA rewrites every scatter not declared
unique into a sort by each entry's row-major offset, computed without bounds checks
(``core.scatter``). That is safe only where an index past the end of its axis is past the
whole array: one index component, into the array's leading axis, with no batching axes.
Everything else (a masked entry ``[g, N]`` of a ``[G, N]`` table, a 1-D scatter under
``vmap``, a column scatter ``x.at[:, a]``) must be a unique scatter. This checks the
lowered programs of every memory system (CPU lowering: the scatters are the same ones the
GPU compiles).
"""

from __future__ import annotations

import re

import pytest

from tests.engine_util import BASE, mesh_for
from ula_jax.config import load_config
from ula_jax.engine import Engine, resolve_max_context

SYSTEMS = {
    "resident": ["memory.system=resident"],
    "ula": ["memory.system=ula", "memory.device_pool=200", "memory.host_pool=600"],
    "hisparse": ["memory.system=hisparse", "memory.hisparse.device_buffer_size=28"],
    "far_tier": ["memory.system=far_tier"],
    "ula_tp": ["mesh.tp=2", "memory.system=ula", "memory.layout=mod",
               "memory.local_buffer=96", "memory.device_pool=296", "memory.host_pool=64"],
}

_DIMS = re.compile(r"scatter_dims_to_operand_dims = \[([0-9, ]*)\]")


def unsafe_scatters(text: str) -> list[str]:
  """The StableHLO scatters of ``text`` that are not declared unique and index more than
  the leading axis (or have batching axes)."""
  out = []
  for line in text.splitlines():
    if "stablehlo.scatter" not in line or "unique_indices = true" in line:
      continue
    dims = _DIMS.search(line)
    if dims is None or dims.group(1).replace(" ", "") != "0" or "input_batching_dims" in line:
      out.append(line.strip()[:240])
  return out


def test_the_check_finds_the_scatters_it_should():
  import jax
  import jax.numpy as jnp

  def text(f, *args):
    return jax.jit(f).lower(*args).as_text()

  x2, i = jnp.zeros((3, 5), jnp.int32), jnp.zeros((4,), jnp.int32)
  masked_column = text(lambda x, i: x.at[1, i].set(7, mode="drop"), x2, i)
  batched = text(jax.vmap(lambda x, i: x.at[i].set(7, mode="drop")), x2, jnp.zeros((3, 4),
                                                                                    jnp.int32))
  rows = text(lambda x, i: x.at[i].set(jnp.ones((4, 5), jnp.int32), mode="drop"), x2, i)
  unique = text(lambda x, i: x.at[1, i].set(7, mode="drop", unique_indices=True), x2, i)
  assert unsafe_scatters(masked_column) and unsafe_scatters(batched)
  assert not unsafe_scatters(rows) and not unsafe_scatters(unique)


@pytest.mark.parametrize("system", sorted(SYSTEMS))
def test_engine_programs_hold_no_unsafe_scatter(system):
  cfg = load_config(BASE, ["model.preset=tiny", "engine.progress=false", "engine.max_batch=4",
                           "mesh.dp=1", "speculative.num_draft=1"] + SYSTEMS[system])
  engine = Engine(cfg, mesh_for(cfg.mesh.dp, cfg.mesh.tp), max_context=resolve_max_context(cfg))
  found = {}
  for kind in ("prefill", "decode", "verify", "release"):
    bad = unsafe_scatters(engine.lower_step(kind).as_text())
    if bad:
      found[kind] = bad[:3]
  assert not found, found
