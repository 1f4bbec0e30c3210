"""What a run compiles is in its summary; with the persistent cache a second identical
run compiles nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tests.engine_util import make_requests, run_engine
from ula_jax.core.compilation import CompileLog, default_cache_dir, enable_persistent_cache


def test_compile_log_counts_programs_by_function(rng):
  # A constant of its own: no persistent cache this process may use (a cache given by
  # the environment may hold programs of earlier sessions) holds the program.
  offset = float(rng.integers(1, 2**24))

  def twice_plus_one(x):
    return 2 * x + offset

  f = jax.jit(twice_plus_one)
  with CompileLog() as log:
    f(jnp.zeros(3))
    f(jnp.zeros(3))  # the same shape: no new program
    f(jnp.zeros(4))
  assert log.programs["twice_plus_one"] == 2
  s = log.summary(("twice_plus_one", "absent"))
  assert s["programs"] == {"twice_plus_one": 2, "absent": 0}
  assert s["total_programs"] >= 2 and s["seconds"]["twice_plus_one"] > 0
  f(jnp.zeros(5))  # closed: not counted
  assert log.programs["twice_plus_one"] == 2


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert default_cache_dir() == tmp_path / "ula_jax" / "xla"


def test_cache_without_a_folder_keeps_the_one_jax_has(monkeypatch, tmp_path):
  # The folder jax is configured with (JAX_COMPILATION_CACHE_DIR, the test session's)
  # stays; without one, default_cache_dir().
  restore = jax.config.jax_compilation_cache_dir
  try:
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "given"))
    assert enable_persistent_cache() == tmp_path / "given"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "given")
    assert enable_persistent_cache(tmp_path / "named") == tmp_path / "named"
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert enable_persistent_cache() == tmp_path / "xdg" / "ula_jax" / "xla"
    assert (tmp_path / "xdg" / "ula_jax" / "xla").is_dir()
  finally:
    jax.config.update("jax_compilation_cache_dir", restore)


def test_run_summary_says_what_each_step_compiled():
  reqs = make_requests(num=2, seed=3, prompt=(5, 9), output=(2, 4))
  result = run_engine(["mesh.dp=1", "engine.max_batch=2", "model.num_layers=6"], reqs)
  c = result.summary["compilation"]
  # One program per kind of step at most, whatever the request lengths.
  assert c["programs"]["decode"] + c["cached"]["decode"] == 1
  assert c["programs"]["prefill"] + c["cached"]["prefill"] == 1
  assert c["programs"]["release"] + c["cached"]["release"] == 1
  assert c["total_seconds"] > 0


def test_a_second_identical_run_compiles_nothing(tmp_path):
  import json
  import subprocess
  import sys

  # Four short requests of the tiny model with every layer dense: what is compiled or
  # read from the cache is the same kinds of step whatever the model and lengths.
  cmd = [sys.executable, "-m", "ula_jax.cli.main", "run", "experiments/quickstart/config.yaml",
         "--no-progress", "workload.num_requests=4", "workload.output_len=[2,4]",
         "model.num_dense_layers=4", "experiment.plots=false",
         f"engine.compilation_cache_dir={tmp_path / 'cache'}"]
  for name in ("first", "second"):
    subprocess.run(cmd + ["--out", str(tmp_path / name)], check=True, capture_output=True)
  first, second = (json.loads((tmp_path / n / "summary.json").read_text())["summary"]
                   ["compilation"] for n in ("first", "second"))
  assert first["programs"]["decode"] == 1 and first["programs"]["prefill"] == 1
  assert second["total_programs"] == 0, second
  assert second["cached"]["decode"] == 1 and second["cached"]["prefill"] == 1
