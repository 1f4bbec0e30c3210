"""kernels.fast_path_mode='speculate': decode steps run on the all-hit path with no
conditional; a dp rank where some group was not all-hit restores its state and runs the
step again. The tokens, and every hit, miss and eviction, are those of 'cond'. The
speculating engine also packs its state (``engine.pack_state``), the other does not."""

from __future__ import annotations

from tests.engine_util import DENSE, make_requests, run_engine


def _totals(result) -> dict:
  return {k: v for k, v in result.summary.items() if k.startswith("total_")}


def test_speculate_equals_cond_with_ranks_kept_and_redone():
  reqs = make_requests(6, seed=7, prompt=(20, 64), output=(5, 10))
  base = DENSE + ["mesh.dp=2", "mesh.tp=1", "engine.max_batch=2"]
  # 96 device slots: most steps hit; a few find no room for the new tokens and evict.
  ula = base + ["memory.system=ula", "memory.device_pool=96", "memory.host_pool=256"]
  # 'cond' decodes resident's tokens (test_exactness); 'speculate' must decode cond's.
  cond = run_engine(ula + ["kernels.fast_path_mode=cond", "engine.pack_state=false"], reqs)
  spec = run_engine(ula + ["kernels.fast_path_mode=speculate", "engine.pack_state=true"],
                    reqs)
  assert [r.output_tokens for r in spec.requests] == [r.output_tokens for r in cond.requests]
  totals = _totals(spec)
  tried, redone = totals.pop("total_spec_steps"), totals.pop("total_spec_redone")
  assert totals == _totals(cond) and totals["total_evictions"] > 0
  assert 0 < redone < tried  # some ranks kept their speculative step, some ran it again
  assert spec.capacity == cond.capacity
