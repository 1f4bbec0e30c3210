"""Engine scheduling: admission by capacity, waiting, rejection, completion.

Every run is of the tiny model with dense MLPs (``DENSE``): scheduling does not depend on
the kind of MLP, whose MoE code is about a quarter of each step's compile time."""

from __future__ import annotations

import dataclasses

import numpy as np

from ula_jax.engine import Request
from tests.engine_util import DENSE, make_requests, run_engine


def test_admission_never_exceeds_capacity_and_everything_completes():
  # 2 dp ranks x 256 tokens (4 pages of 64): at most a few requests fit at once.
  reqs = make_requests(num=8, seed=7, prompt=(70, 120), output=(3, 6))
  seen = []
  res = run_engine(DENSE + ["mesh.dp=2", "engine.max_batch=4", "memory.device_pool=256",
                            "engine.page_size=64"], reqs, on_step=seen.append)
  assert [r.status for r in res.requests] == ["finished"] * len(reqs)
  cap = np.asarray(res.capacity["device_capacity"]).sum()
  assert all(m.device_used <= cap for m in seen)
  # Capacity, not rows, limited concurrency: some requests had to wait.
  assert max(m.waiting for m in seen) > 0
  assert max(m.running for m in seen) <= 2 * 2
  for r, q in zip(res.requests, reqs):
    assert len(r.output_tokens) == q.max_new_tokens
  # Every slot is free again at the end.
  assert seen[-1].device_used == 0


def test_request_that_can_never_fit_is_rejected_and_the_rest_goes_on():
  reqs = list(make_requests(num=3, seed=3, prompt=(10, 20), output=(2, 4)))
  huge = Request(id="huge", prompt=np.ones(400, np.int32), max_new_tokens=4)
  res = run_engine(DENSE + ["mesh.dp=2", "engine.max_batch=2", "memory.device_pool=256",
                            "engine.max_context=320"], reqs + [huge])
  by_id = {r.id: r for r in res.requests}
  assert by_id["huge"].status == "rejected"
  assert "engine.max_context=320" in by_id["huge"].reason
  assert all(by_id[r.id].status == "finished" for r in reqs)


def test_request_larger_than_memory_is_rejected_with_the_memory_limit():
  reqs = [Request(id="big", prompt=np.ones(300, np.int32), max_new_tokens=2),
          Request(id="ok", prompt=np.ones(30, np.int32), max_new_tokens=2)]
  res = run_engine(DENSE + ["mesh.dp=1", "engine.max_batch=2", "memory.device_pool=128",
                            "engine.max_context=320"], reqs)
  by_id = {r.id: r for r in res.requests}
  assert by_id["big"].status == "rejected"
  assert "holds at most 128" in by_id["big"].reason
  assert by_id["ok"].status == "finished"


def test_late_arrivals_and_max_steps_report_unfinished_requests():
  reqs = [dataclasses.replace(r, arrival_step=5 * i)
          for i, r in enumerate(make_requests(num=3, seed=5, prompt=(10, 20), output=(20, 30)))]
  res = run_engine(DENSE + ["mesh.dp=1", "engine.max_batch=2", "engine.max_steps=12"], reqs)
  statuses = {r.id: (r.status, r.reason) for r in res.requests}
  assert len(statuses) == 3  # nothing lost
  assert all(s == "rejected" and "engine.max_steps=12" in why for s, why in statuses.values())
  assert res.summary["steps"] == 12


def test_idle_time_before_a_late_arrival_is_jumped_over():
  req = dataclasses.replace(make_requests(num=1, seed=7, prompt=(10, 12), output=(3, 4))[0],
                            arrival_step=1_000_000_000)
  seen = []
  res = run_engine(DENSE + ["mesh.dp=1", "engine.max_batch=1"], [req], on_step=seen.append)
  assert res.requests[0].status == "finished"
  # No metrics line per idle step: the first step recorded is the arrival.
  assert seen[0].step == 1_000_000_000 and len(seen) < 20
  assert res.summary["steps"] == len(seen)


def test_time_in_the_step_callback_counts_in_neither_wall_time_nor_ttft(monkeypatch):
  """Metrics, progress and checkpoints run in the step callback, between steps: a slow
  one (a checkpoint of large pools takes minutes) must not read as a slow run. The
  engine's clock is moved on by an hour in each callback (no sleeping, so no timing
  noise): anything that counted the callbacks would read hours."""
  import time
  import types

  from ula_jax.engine import engine as engine_module

  hour = 3600.0
  clock = types.SimpleNamespace(offset=0.0)
  monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(
      perf_counter=lambda: time.perf_counter() + clock.offset))

  def slow_callback(m) -> None:
    clock.offset += hour

  # Prompts of 3-4 prefill chunks: a request's first token comes steps after admission.
  reqs = make_requests(num=4, seed=5, prompt=(40, 60), output=(3, 5))
  args = (DENSE + ["mesh.dp=2", "engine.max_batch=2", "engine.prefill_chunk=16"], reqs)
  fast = run_engine(*args)
  slow = run_engine(*args, on_step=slow_callback)
  steps = slow.summary["steps"]
  assert steps == fast.summary["steps"] and steps >= 3
  assert slow.summary["callback_time_s"] >= steps * hour
  assert fast.summary["callback_time_s"] == 0.0
  assert [r.output_tokens for r in slow.requests] == [r.output_tokens for r in fast.requests]
  # The run took hours longer by its clock, but its wall time leaves them out.
  assert slow.summary["wall_time_s"] < hour / 2
  # A request waiting for its first token over several steps is not charged the pauses.
  assert all(s.first_token_step - s.admitted_step >= 2 for s in slow.requests)
  assert all(s.ttft_s < hour / 2 for s in slow.requests)
