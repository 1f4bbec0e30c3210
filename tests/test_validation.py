"""Nothing lost, nothing misleading: every check the config allows runs at validation time,
values that would be silently reinterpreted or ignored are errors, environment problems
exit 2 with a message, and a sweep keeps going past a failed combination."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys

import pytest

from ula_jax.cli.main import EXIT_OK, EXIT_USAGE, main, sweep_plan
from ula_jax.config import ConfigError, load_config, validate
from ula_jax.config.loader import REPO_CONFIGS
from ula_jax.memory import check_config
from ula_jax.mesh import MAX_CPU_DEVICES, configure_platform

QUICKSTART = str(REPO_CONFIGS.parent / "experiments" / "quickstart" / "config.yaml")
EXPERIMENTS = REPO_CONFIGS.parent / "experiments"


def error_of(capsys, argv: list[str]) -> str:
  """The stderr of ``ula-jax argv``, which must exit 2."""
  assert main(argv) == EXIT_USAGE
  return capsys.readouterr().err


# ----------------------------------------------------------------------------------
# booleans are not numbers
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("override,match", [
    ("engine.max_batch=true", r"engine.max_batch=True: expected an integer, not a boolean"),
    ("mesh.dp=false", r"mesh.dp=False: expected an integer, not a boolean"),
    ("engine.max_context=true", r"engine.max_context=True: expected an integer"),
    ("workload.length_scale=true", r"workload.length_scale=True: expected a number"),
    ("memory.hisparse.host_to_device_ratio=true",
     r"memory.hisparse.host_to_device_ratio=True: expected a number"),
    ("model.num_layers=true", r"model.num_layers=true: expected an integer, not a boolean"),
])
def test_booleans_are_not_numbers(override, match):
  with pytest.raises(ConfigError, match=match):
    load_config(QUICKSTART, [override])


def test_booleans_still_set_boolean_fields():
  assert load_config(QUICKSTART, ["engine.pack_state=false"]).engine.pack_state is False


# ----------------------------------------------------------------------------------
# fields the chosen memory system never reads
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,match", [
    (["memory.host_pool=100"], r"memory.host_pool=100 is not used by memory.system='resident' "
     r"\(only by ula and hisparse\)"),
    (["memory.policy=lru"], r"memory.policy='lru' is not used by memory.system='resident'"),
    (["memory.system=hisparse", "memory.pb_lru_buckets=2"],
     r"memory.pb_lru_buckets=2 is not used by memory.system='hisparse' \(only by ula\)"),
    (["memory.system=ula", "memory.hisparse.device_buffer_size=64"],
     r"memory.hisparse.device_buffer_size=64 is not used by memory.system='ula'"),
    (["memory.system=hisparse", "memory.far_tier.link=rdma"],
     r"memory.far_tier.link='rdma' is not used by memory.system='hisparse' \(only by far_tier\)"),
    (["memory.system=far_tier", "memory.layout=block"],
     r"memory.layout='block' is not used by memory.system='far_tier'"),
    (["memory.local_buffer=64"], r"memory.local_buffer=64 is not used by memory.system='resident'"),
    (["memory.system=hisparse", "memory.host_layout=layer_major"],
     r"memory.host_layout='layer_major' is not used by memory.system='hisparse' \(only by ula\)"),
    (["memory={system: resident, host_pool: 8}"], r"memory.host_pool=8 is not used"),
])
def test_a_field_the_system_does_not_read_is_an_error(overrides, match):
  with pytest.raises(ConfigError, match=match):
    load_config(QUICKSTART, overrides)


def test_unused_fields_count_only_when_set_to_a_non_default_value():
  # Defaults, a building block of another system, and the replicated layout resident
  # itself uses are not mistakes.
  load_config(QUICKSTART, ["memory.host_pool=0", "memory.policy=pb_lru"])
  load_config(QUICKSTART, ["memory=ula_lru", "memory.system=resident"])
  load_config(QUICKSTART, ["memory.layout=replicated"])
  # Experiment files may hold the fields of every system a block sweep compares.
  for block in ("resident", "ula_pb_lru", "hisparse", "far_tier_cxl"):
    check_config(load_config(EXPERIMENTS / "memory_systems_small" / "config.yaml",
                             [f"memory={block}"]))
  check_config(load_config(EXPERIMENTS / "tp_layouts" / "config.yaml", ["memory=resident"]))


def test_a_plain_dict_counts_every_field_it_gives():
  data = {"experiment": {"name": "t"}, "model": {"preset": "tiny"},
          "workload": {"length_scale": 0.002, "output_len": [16, 32]},
          "memory": {"system": "resident", "far_tier": {"num_far_devices": 2}}}
  with pytest.raises(ConfigError, match=r"memory.far_tier.num_far_devices=2 is not used"):
    validate(data)


# ----------------------------------------------------------------------------------
# the memory system's own checks, before anything runs
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,match", [
    (["memory.system=hisparse", "memory.hisparse.top_k=4"],
     r"memory.hisparse.top_k=4: must equal model.index_topk=8"),
    (["memory.device_pool=10"],
     r"memory.device_pool holds 0 tokens per device, fewer than one page"),
    (["memory.system=hisparse", "memory.hisparse.device_buffer_size=8",
      "memory.device_pool=10"],
     r"memory.device_pool holds 10 tokens per device, fewer than max_batch x "
     r"\(device_buffer_size \+ 1\)"),
    (["memory.system=ula", "mesh.dp=1", "mesh.tp=2", "memory.local_buffer=5"],
     r"memory.local_buffer=5 .*one decode step"),
    (["memory.system=far_tier", "memory.far_tier.far_pool=8"],
     r"far_tier \(on_demand\) holds 0 tokens per dp rank, fewer than one page"),
])
def test_config_verb_runs_the_memory_systems_checks(capsys, overrides, match):
  err = error_of(capsys, ["config", QUICKSTART, *overrides])
  assert re.search(match, err), err


def test_shipped_block_sweeps_pass_every_check():
  sweeps = {"memory_systems_small": ["resident", "ula_pb_lru", "ula_lru", "hisparse",
                                     "far_tier_cxl"],
            "glm5_summarization": ["ula_pb_lru", "hisparse", "resident"],
            "dsv32_summarization": ["ula_pb_lru", "hisparse", "resident"],
            "far_tier": ["far_tier_cxl", "far_tier_rdma"]}
  for name, blocks in sweeps.items():
    for block in blocks:
      check_config(load_config(EXPERIMENTS / name / "config.yaml", [f"memory={block}"]))
  for layout in ("mod", "block", "request"):
    check_config(load_config(EXPERIMENTS / "tp_layouts" / "config.yaml",
                             [f"memory.layout={layout}"]))


# ----------------------------------------------------------------------------------
# sweeps
# ----------------------------------------------------------------------------------


def test_a_key_both_fixed_and_swept_is_an_error():
  with pytest.raises(ConfigError, match=r"sweep: memory.system is both fixed "
                     r"\(memory.system=ula\) and swept \(memory.system=resident,hisparse\)"):
    sweep_plan(["memory.system=ula", "memory.system=resident,hisparse"])


def test_sweep_validates_every_combination_with_the_systems_checks(tmp_path, capsys):
  out = tmp_path / "sweep"
  err = error_of(capsys, ["sweep", QUICKSTART, "memory.system=resident,hisparse",
                          "memory.device_pool=10", "--out", str(out)])
  assert "combination memory.system=resident: memory.device_pool holds 0 tokens" in err
  assert "combination memory.system=hisparse: memory.device_pool holds 10 tokens" in err
  assert not out.exists()


def test_a_failed_combination_is_recorded_and_the_sweep_goes_on(tmp_path, capsys,
                                                                 monkeypatch):
  import ula_jax.report.stats
  import ula_jax.run

  ran = []

  def fake_run(cfg, out_dir=None, **kwargs):
    ran.append(cfg.engine.max_batch)
    if cfg.engine.max_batch == 2:
      raise RuntimeError("out of device memory")
    return None, out_dir

  monkeypatch.setattr(ula_jax.run, "run_experiment", fake_run)
  monkeypatch.setattr(ula_jax.report.stats, "run_stats",
                      lambda result: {"tokens_per_s": 1.0, "peak_batch": 1, "finished": 1})
  out = tmp_path / "sweep"
  assert main(["sweep", QUICKSTART, "engine.max_batch=1,2,3", "--out", str(out),
               "--no-progress"]) == 1
  assert ran == [1, 2, 3]  # the combination after the failure still ran
  err = capsys.readouterr().err
  assert re.search(r"1 of 3 combinations failed.*engine.max_batch=2", err)
  rows = json.loads((out / "sweep.json").read_text())["rows"]
  assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
  assert rows[1]["error"] == "RuntimeError: out of device memory"
  with (out / "sweep.csv").open() as f:
    table = list(csv.DictReader(f))
  assert table[1]["status"] == "failed" and "out of device memory" in table[1]["error"]


# ----------------------------------------------------------------------------------
# the environment
# ----------------------------------------------------------------------------------


def test_a_mesh_beyond_the_simulated_cpu_devices_fails_fast(capsys):
  cfg = load_config(QUICKSTART, ["mesh.dp=100000"])
  with pytest.raises(ConfigError, match=rf"mesh.dp\*mesh.tp = 100000\*1 = 100000 devices with "
                     rf"mesh.platform=cpu: at most {MAX_CPU_DEVICES} simulated CPU devices"):
    configure_platform(cfg)
  err = error_of(capsys, ["run", QUICKSTART, "mesh.dp=100000", "--no-progress"])
  assert "lower mesh.dp or mesh.tp" in err


def test_pools_larger_than_the_machine_exit_2(tmp_path, capsys):
  out = tmp_path / "run"
  err = error_of(capsys, ["run", QUICKSTART, "memory.device_pool=1TiB", "--out", str(out),
                          "--no-progress"])
  assert re.search(r"memory.device_pool='1TiB'.*memory.system='resident' would allocate .* "
                   r"GiB of pools per device.*more than its .* GiB of RAM", err), err
  assert not out.exists()


def test_model_parameters_count_against_the_machine():
  import jax
  from flax import nnx

  from ula_jax.core.host_memory import host_ram
  from ula_jax.memory import check_fits_machine
  from ula_jax.mesh import build_mesh
  from ula_jax.models import transformer as tfm
  cfg = load_config(QUICKSTART, ["mesh.platform=cpu"])
  model = tfm.Transformer(cfg.model, rngs=nnx.Rngs(cfg.model.param_seed))
  _, params = nnx.split(model)
  assert tfm.param_bytes(cfg.model) == sum(x.nbytes for x in jax.tree.leaves(params))
  mesh = build_mesh(cfg)
  check_fits_machine(cfg, mesh, params_bytes=tfm.param_bytes(cfg.model))
  with pytest.raises(ConfigError, match=r"GiB of pools per device beside the model's .* GiB "
                     r"of parameters, .* more than its .* GiB of RAM"):
    check_fits_machine(cfg, mesh, params_bytes=host_ram())


def test_host_pools_larger_than_the_machine_exit_2(capsys):
  err = error_of(capsys, ["run", QUICKSTART, "memory.system=ula", "memory.device_pool=1024",
                          "memory.host_pool=1TiB", "--no-progress"])
  assert re.search(r"memory.device_pool=1024, memory.host_pool='1TiB': memory.system='ula' "
                   r"would allocate", err), err
  # Most of it are the host tier's indexer keys, which live on the device: said so.
  assert re.search(r"of pools per device \([0-9.]+ GiB of them indexer keys, one per "
                   r"logical address of every layer group, host tier included\)", err), err


def test_pools_beyond_int32_addresses_are_a_config_error(capsys):
  err = error_of(capsys, ["config", QUICKSTART, "memory.system=ula", "memory.device_pool=1024",
                          "memory.host_pool=64TiB"])
  assert re.search(r"memory.host_pool='64TiB': memory.system='ula' would hold \d+ tokens per "
                   r"device, beyond the 2147483647 int32 addresses", err), err


def test_gpu_platform_without_a_gpu_exits_2(tmp_path):
  import os

  # A fresh process, with every GPU hidden (so this runs on a GPU machine too): selecting
  # the platform changes jax's global configuration.
  env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
  env.pop("JAX_PLATFORMS", None)
  proc = subprocess.run(
      [sys.executable, "-c", "import sys; from ula_jax.cli.main import main; sys.exit(main())",
       "run", QUICKSTART, "mesh.platform=gpu",
       "--no-progress", "--out", str(tmp_path / "run")],
      capture_output=True, text=True, timeout=120, check=False, env=env)
  assert proc.returncode == EXIT_USAGE, proc.stderr[-2000:]
  assert "mesh.platform='gpu'" in proc.stderr


def test_bench_argument_errors_exit_2(capsys):
  err = error_of(capsys, ["bench", "resolve", "--pools", "abc"])
  assert re.search(r"error: ula-jax bench resolve: --pools: .*'abc'", err, re.IGNORECASE), err


def test_config_exits_0_when_everything_passes(capsys):
  assert main(["config", QUICKSTART, "memory.system=ula"]) == EXIT_OK
