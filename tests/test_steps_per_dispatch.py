"""``engine.steps_per_dispatch``: several decode steps in one device program.

Rows of different lengths stop at their own length inside the dispatch; requests arrive
while others decode, so admission and prefill run between dispatches. The greedy tokens
equal those of one step per dispatch, request by request, for every memory system
(pools small enough that entries miss and are evicted), with dp = 2 and with tp = 2.
"""

from __future__ import annotations

import functools

import pytest

from ula_jax.config import ConfigError, load_config
from tests.engine_util import BASE, DENSE, TIGHT_SYSTEMS, make_requests, run_engine

STEPS = 3  # decode steps per dispatch (does not divide the requests' lengths)


@functools.lru_cache(maxsize=None)
def _requests():
  reqs = make_requests(num=5, seed=31, prompt=(20, 60), output=(4, 11))
  # Arrivals spread over the run: new requests are admitted between dispatches.
  return tuple(r.__class__(id=r.id, prompt=r.prompt, max_new_tokens=r.max_new_tokens,
                           arrival_step=2 * i) for i, r in enumerate(reqs))


def _tokens(overrides: list[str]) -> dict:
  res = run_engine(["engine.max_batch=2"] + DENSE + overrides, _requests())
  assert all(r.status == "finished" for r in res.requests), [r.status for r in res.requests]
  return {r.id: r.output_tokens for r in res.requests}


@functools.lru_cache(maxsize=None)
def _reference() -> dict:
  return _tokens(["mesh.dp=1"])


@pytest.mark.parametrize("system,mesh", [
    ("resident", ["mesh.dp=2"]),
    ("ula", ["mesh.dp=1"]),
    ("hisparse", ["mesh.dp=1"]),
    ("far_tier", ["mesh.dp=1"]),
    ("ula", ["mesh.dp=1", "mesh.tp=2", "memory.layout=mod", "memory.local_buffer=64"]),
])
def test_tokens_equal_one_step_per_dispatch(system, mesh):
  over = [f"engine.steps_per_dispatch={STEPS}"] + mesh + TIGHT_SYSTEMS[system]
  if "mesh.tp=2" in mesh:  # TP mode: its own pool sizes (a local buffer per rank)
    over = [o for o in over if not o.startswith(("memory.device_pool", "memory.host_pool"))]
    over += ["memory.device_pool=192"]
  assert _tokens(over) == _reference()


def test_a_dispatch_is_one_engine_step():
  res = run_engine(["engine.max_batch=2", "mesh.dp=1", f"engine.steps_per_dispatch={STEPS}"]
                   + DENSE, _requests()[:1])
  (r,) = res.requests
  decoding = [m for m in res.steps if m.decode_tokens]
  # One compute-prefill step gives the first token; each dispatch then up to STEPS more.
  assert [m.decode_tokens for m in decoding] == [
      min(STEPS, r.max_new_tokens - 1 - STEPS * i)
      for i in range(-(-(r.max_new_tokens - 1) // STEPS))]
  assert res.summary["generated_tokens"] == r.max_new_tokens


@pytest.mark.parametrize("other", ["speculative.num_draft=1", "engine.record_trace=true",
                                   "kernels.fast_path_mode=speculate"])
def test_refused_with_what_it_cannot_run(other):
  with pytest.raises(ConfigError, match="engine.steps_per_dispatch=4 .* cannot be combined"):
    load_config(BASE, ["model.preset=tiny", "engine.steps_per_dispatch=4", other])
