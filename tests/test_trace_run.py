"""A recorded run: trace files, and both policies' hit rates on the same selections."""

from __future__ import annotations

import json

from ula_jax.config import load_config
from ula_jax.memory.ula.trace import SelectionTrace
from ula_jax.run import run_experiment
from ula_jax.workloads.trace import replay_workload
from tests.engine_util import DENSE, mesh_for


OVERRIDES = [*DENSE, "mesh.dp=2", "workload.num_requests=4", "memory.system=ula",
             "memory.policy=pb_lru", "memory.device_pool=48", "memory.host_pool=2048",
             "engine.max_batch=2", "engine.progress=false", "experiment.plots=false"]


def test_ula_run_records_traces_and_compares_policies(tmp_path):
  cfg = load_config("experiments/quickstart/config.yaml",
                    [*OVERRIDES, "engine.record_trace=true"])
  result, run_dir = run_experiment(cfg, tmp_path / "run", progress=False,
                                   mesh=mesh_for(2), show=False)
  traces = [SelectionTrace.load(run_dir / f"trace_rank{d}.npz") for d in range(2)]
  assert sum(t.num_steps for t in traces) > 0
  for t in traces:
    t.validate()
  cmp = json.loads((run_dir / "summary.json").read_text())["summary"]["policy_comparison"]
  assert set(cmp) >= {"pb_lru", "lru", "hit_rate_gap_pp"}
  assert cmp["pb_lru"]["misses"] > 0 and cmp["lru"]["misses"] > 0
  # Replaying the run's own policy reproduces what the live run counted.
  assert cmp["pb_lru"]["hits"] == result.summary["total_hits"]
  assert cmp["pb_lru"]["misses"] == result.summary["total_misses"]
  assert cmp["pb_lru"]["evictions"] == result.summary["total_evictions"]
  # The locality statistics of the recorded selections are in the summary too.
  loc = json.loads((run_dir / "summary.json").read_text())["summary"]["locality"]
  assert loc["trace"]["ranks"] == 2 and 0 <= loc["overlap"]["mean"] <= 1
  assert set(loc["lru_buffer"]) == {"k", "2k", "4k"} and set(loc["shared_pool"]) == set(
      loc["lru_buffer"])
  # So does the run directory replayed as a trace workload (both engines).
  for engine in ("fast", "system"):
    replayed = replay_workload(load_config("experiments/quickstart/config.yaml", [
        *OVERRIDES, "workload.kind=trace", f"workload.trace={run_dir}",
        f"workload.trace_replay={engine}"]))
    for k in ("hits", "misses", "evictions"):
      assert replayed.summary[f"total_{k}"] == result.summary[f"total_{k}"], (engine, k)
