"""kernels.fast_path_mode='speculate': decode steps run on the all-hit path with no
conditional; a dp rank where some group was not all-hit restores its state and runs the
step again (with the fast path per group, or with the full resolve and no conditional).
The tokens, and every hit, miss and eviction, are those of 'cond'. The speculating
engine also packs its state (``engine.pack_state``), the other does not."""

from __future__ import annotations

import re

from tests.engine_util import BASE, DENSE, make_requests, mesh_for, run_engine
from ula_jax.config import load_config
from ula_jax.engine import Engine, resolve_max_context


def _totals(result) -> dict:
  return {k: v for k, v in result.summary.items() if k.startswith("total_")}


def test_speculate_equals_cond_with_ranks_kept_and_redone():
  """Steps that are not speculated run the fast path per group ('cond',
  ``kernels.resolve_fast_path=true``) or the full resolve with no conditional ('full')."""
  reqs = make_requests(6, seed=7, prompt=(20, 64), output=(5, 10))
  base = DENSE + ["mesh.dp=2", "mesh.tp=1", "engine.max_batch=2"]
  # 96 device slots: most steps hit; a few find no room for the new tokens and evict.
  ula = base + ["memory.system=ula", "memory.device_pool=96", "memory.host_pool=256"]
  # 'cond' decodes resident's tokens (test_exactness); 'speculate' must decode cond's.
  cond = run_engine(ula + ["kernels.fast_path_mode=cond", "engine.pack_state=false"], reqs)
  for fallback in ("cond", "full"):
    spec = run_engine(ula + ["kernels.fast_path_mode=speculate", "engine.pack_state=true",
                            f"kernels.resolve_fast_path={fallback == 'cond'}"], reqs)
    assert ([r.output_tokens for r in spec.requests]
            == [r.output_tokens for r in cond.requests]), fallback
    totals = _totals(spec)
    tried, redone = totals.pop("total_spec_steps"), totals.pop("total_spec_redone")
    assert totals == _totals(cond) and totals["total_evictions"] > 0, fallback
    assert 0 < redone < tried, fallback  # some ranks kept their speculative step, some redid it
    assert spec.capacity == cond.capacity, fallback


def test_no_decode_program_has_a_conditional_with_the_full_fallback():
  """With ``kernels.resolve_fast_path=false`` neither decode program has a conditional
  (on a GPU each one waits for the device); with the fast path the plain step has one
  (per layer group, in the layers' loop)."""
  found = {}
  for fast in (True, False):
    cfg = load_config(BASE, ["model.preset=tiny", "engine.progress=false", *DENSE,
                             "mesh.dp=1", "engine.max_batch=2", "memory.system=ula",
                             "memory.device_pool=96", "memory.host_pool=256",
                             "kernels.fast_path_mode=speculate",
                             f"kernels.resolve_fast_path={fast}"])
    engine = Engine(cfg, mesh_for(1, 1), max_context=resolve_max_context(cfg))
    for kind in ("decode", "speculate"):
      text = engine.lower_step(kind).as_text()
      found[fast, kind] = len(re.findall(r"stablehlo\.(?:case|if)\b", text))
  assert found == {(True, "decode"): 1, (True, "speculate"): 0,
                   (False, "decode"): 0, (False, "speculate"): 0}
