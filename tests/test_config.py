"""The config schema, composition, overrides, error messages and the mesh."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import pydantic
import pytest
import yaml

from ula_jax.config import (BLOCK_SECTIONS, ConfigError, EngineConfig, ExperimentConfig,
                            ExperimentInfo, FarTierConfig, HiSparseConfig, KernelsConfig,
                            MemoryConfig, MeshConfig, ModelConfig, WorkloadConfig,
                            check_devices, compose, config_to_yaml, load_config,
                            parse_overrides, validate)
from ula_jax.config.loader import REPO_CONFIGS
from ula_jax.mesh import build_mesh, check_kernels, configure_platform, interpret_kernels

QUICKSTART = REPO_CONFIGS.parent / "experiments" / "quickstart" / "config.yaml"
EXPERIMENTS = sorted((REPO_CONFIGS.parent / "experiments").glob("*/config.yaml"))


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
  path = tmp_path / name
  path.write_text(text)
  return path


def cfg_of(**sections) -> ExperimentConfig:
  """A validated config from plain dicts (tiny model, short workload by default)."""
  data = {"experiment": {"name": "t"}, "model": {"preset": "tiny"},
          "workload": {"length_scale": 0.002, "output_len": [16, 32]}}
  for k, v in sections.items():
    data[k] = {**data.get(k, {}), **v}
  return validate(data)


# ----------------------------------------------------------------------------------
# shipped YAML
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: p.parent.name)
def test_every_experiment_file_validates_and_round_trips(path, tmp_path):
  cfg = load_config(path)
  assert cfg.experiment.name == path.parent.name
  resolved = write(tmp_path, config_to_yaml(cfg), "config.yaml")
  assert load_config(resolved) == cfg


BLOCKS = [(s, p.stem) for s in BLOCK_SECTIONS for p in sorted((REPO_CONFIGS / s).glob("*.yaml"))]


@pytest.mark.parametrize("section,name", BLOCKS, ids=lambda v: str(v))
def test_every_building_block_composes(section, name, tmp_path):
  # glm5 has 64 heads (any tp of the shipped meshes) and a long max_position.
  defaults = {"model": "glm5", "workload": "summarization_small", section: name}
  path = write(tmp_path, yaml.safe_dump({"defaults": defaults}))
  cfg = load_config(path)
  block = yaml.safe_load((REPO_CONFIGS / section / f"{name}.yaml").read_text()) or {}
  got = getattr(cfg, section).model_dump()
  for key, value in block.items():
    if value is None:  # "derived" (engine.max_context) or None
      continue
    if isinstance(value, dict):
      for k, v in value.items():
        assert got[key][k] == (tuple(v) if isinstance(v, list) else v)
    else:
      assert got[key] == (tuple(value) if isinstance(value, list) else value)


def test_quickstart_shape():
  cfg = load_config(QUICKSTART)
  assert cfg.model.preset == "tiny"
  assert (cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.platform) == (8, 1, "cpu")
  assert cfg.workload.num_requests == 16
  assert cfg.workload.prompt_len == (65536, 131072)
  lo, hi = cfg.workload.prompt_range
  assert 100 <= lo < hi <= 250
  assert cfg.workload.output_range == (16, 32)
  assert cfg.memory.system == "resident"
  # max_context derived: longest prompt + longest output, rounded up to a page.
  assert cfg.engine.max_context == -(-(hi + 32) // cfg.engine.page_size) * cfg.engine.page_size


# ----------------------------------------------------------------------------------
# schema
# ----------------------------------------------------------------------------------


def test_defaults_of_every_section():
  cfg = validate({"experiment": {"name": "d"}, "workload": {"length_scale": 0.01}})
  assert cfg.memory.system == "resident" and cfg.memory.device_pool is None
  assert cfg.memory.host_pool == 0 and cfg.memory.policy == "pb_lru"
  assert cfg.memory.pb_lru_buckets == 32 and cfg.memory.layout == "mod"
  assert cfg.memory.hisparse.device_buffer_size == 4096
  assert cfg.memory.hisparse.host_to_device_ratio == 2.0
  assert cfg.memory.far_tier.mode == "on_demand" and cfg.memory.far_tier.link == "cxl"
  assert (cfg.mesh.dp, cfg.mesh.tp, cfg.mesh.platform) == (1, 1, "auto")
  assert cfg.workload.output_len == (128, 512) and cfg.workload.arrival == "all_at_once"
  assert (cfg.engine.max_batch, cfg.engine.prefill_chunk, cfg.engine.page_size) == (8, 256, 64)
  assert (cfg.kernels.attention, cfg.kernels.fetch, cfg.kernels.resolve) == ("auto",) * 3
  assert cfg.experiment.out_dir == "runs" and cfg.experiment.plots


def test_configs_are_frozen_and_hashable():
  cfg = cfg_of()
  with pytest.raises(pydantic.ValidationError, match="frozen"):
    cfg.engine.max_batch = 3
  assert hash(cfg) == hash(cfg_of())
  assert cfg_of(engine={"max_batch": 3}) != cfg


def test_max_context_is_derived_from_the_workload_and_rounded_to_a_page():
  cfg = cfg_of(workload={"prompt_len": [10, 100], "length_scale": 1.0, "output_len": [5, 7]},
               engine={"page_size": 16})
  assert cfg.engine.max_context == 112  # 100 + 7 = 107 -> 7 pages of 16
  explicit = cfg_of(engine={"max_context": 512})
  assert explicit.engine.max_context == 512


def test_scaled_lengths_are_at_least_one():
  cfg = cfg_of(workload={"prompt_len": [1, 3], "length_scale": 0.01, "output_len": [1, 2],
                         "output_scale": 0.1})
  assert cfg.workload.prompt_range == (1, 1)
  assert cfg.workload.output_range == (1, 1)


def test_top_k_is_hisparse_top_k_or_the_models():
  assert cfg_of().top_k == 8
  assert cfg_of(memory={"system": "hisparse", "hisparse": {"top_k": 8}}).top_k == 8
  # HiSparse's buffer holds the indexer's selection: another top-k can never run.
  with pytest.raises(ConfigError, match=r"memory.hisparse.top_k=4: must equal "
                     r"model.index_topk=8 \(or be left unset\)"):
    cfg_of(memory={"system": "hisparse", "hisparse": {"top_k": 4}})


def test_sizes_accept_tokens_and_bytes():
  cfg = cfg_of(memory={"system": "ula", "device_pool": "8GiB", "host_pool": 4096})
  assert cfg.memory.device_pool == "8GiB" and cfg.memory.host_pool == 4096


# ----------------------------------------------------------------------------------
# error messages
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sections,match", [
    ({"memory": {"polcy": "lru"}}, r"unknown field 'memory.polcy' \(did you mean 'policy'\?\)"),
    ({"memory": {"hisparse": {"top_kk": 1}}},
     r"unknown field 'memory.hisparse.top_kk' \(did you mean 'top_k'\?\)"),
    ({"modl": {}}, r"unknown field 'modl' \(did you mean 'model'\?\)"),
    ({"model": {"hiden_size": 3}}, r"model.hiden_size \(did you mean hidden_size"),
    ({"memory": {"policy": "fifo"}}, r"memory.policy='fifo': expected one of 'pb_lru' or 'lru'"),
    ({"memory": {"pb_lru_buckets": 0}}, r"memory.pb_lru_buckets=0: must be >= 1"),
    ({"mesh": {"dp": 0}}, r"mesh.dp=0: must be >= 1"),
    ({"mesh": {"tp": "two"}}, r"mesh.tp='two': expected an integer"),
    ({"workload": {"length_scale": "big"}}, r"workload.length_scale='big': expected a number"),
    ({"workload": {"arrival_rate": 0}}, r"workload.arrival_rate=0: must be > 0"),
    ({"engine": {"progress": "maybe"}}, r"engine.progress='maybe': expected true or false"),
    ({"engine": {"max_batch": 0}}, r"engine.max_batch=0: must be >= 1"),
    ({"kernels": {"fetch": "cuda"}},
     r"kernels.fetch='cuda': expected one of 'auto', 'xla', 'pallas' or 'ffi'"),
    ({"memory": {"device_pool": "8GB2"}}, r"memory.device_pool='8GB2': expected a token count"),
    ({"memory": {"device_pool": [1]}}, r"memory.device_pool=\[1\]: expected a token count"),
    ({"memory": {"device_pool": -5}}, r"memory.device_pool=-5: must be >= 0 tokens"),
    ({"memory": {"host_pool": None}}, r"memory.host_pool=None: expected a token count"),
    ({"memory": {"far_tier": {"far_pool": "lots"}}}, r"memory.far_tier.far_pool='lots'"),
    ({"memory": {"local_buffer": 0}}, r"memory.local_buffer=0: must be >= 1"),
    ({"workload": {"prompt_len": [5, 1]}},
     r"workload.prompt_len=\[5, 1\]: expected a pair \[min, max\] of integers with "
     r"1 <= min <= max"),
    ({"workload": {"output_len": 3}}, r"workload.output_len=3: expected a pair"),
    ({"workload": {"kind": "file"}}, r"workload.kind='file' needs workload.path"),
    ({"experiment": {"name": "a/b"}}, r"experiment.name='a/b': use letters, digits"),
])
def test_bad_fields_are_named_with_value_and_what_is_valid(sections, match):
  with pytest.raises(ConfigError, match=match):
    cfg_of(**sections)


def test_missing_name_is_reported():
  with pytest.raises(ConfigError, match=r"experiment.name: required, not set"):
    validate({"experiment": {}})


def test_every_problem_is_listed_in_one_message():
  with pytest.raises(ConfigError, match=r"3 problems") as e:
    cfg_of(memory={"polcy": "lru"}, mesh={"dp": 0}, kernels={"attention": "cuda"})
  assert len(e.value.problems) == 3
  assert any("memory.polcy" in p for p in e.value.problems)
  assert any("mesh.dp=0" in p for p in e.value.problems)
  assert any("kernels.attention='cuda'" in p for p in e.value.problems)


def test_mosaic_attention_takes_its_geometry_on_a_gpu():
  """kernels.attention=mosaic: 64 heads per device of 512 + 64 bf16 columns (glm5 at tp 1,
  dsv32 at tp 2), on a GPU only."""
  with pytest.raises(ConfigError, match=r"kernels.attention='mosaic' takes 64 heads per "
                     r"device of 512 \+ 64 bf16 entry columns; got model.num_heads / "
                     r"mesh.tp = 4, model.kv_lora_rank=32"):
    cfg_of(kernels={"attention": "mosaic"})
  wide = {"preset": "glm5", "max_position": 1 << 20}
  cfg = cfg_of(model=wide, kernels={"attention": "mosaic"})
  cfg_of(model={**wide, "preset": "dsv32"}, mesh={"tp": 2}, kernels={"attention": "mosaic"})
  with pytest.raises(ConfigError, match=r"model.num_heads / mesh.tp = 32"):
    cfg_of(model=wide, mesh={"tp": 2}, kernels={"attention": "mosaic"})
  with pytest.raises(ConfigError, match=r"kernels.attention=mosaic on cpu: the Mosaic GPU "
                     r"kernel runs on Hopper GPUs only"):
    check_kernels(cfg, "cpu")
  check_kernels(cfg, "gpu")


@pytest.mark.parametrize("sections,match", [
    ({"engine": {"max_context": 100}},
     r"engine.max_context=100 is not a multiple of engine.page_size=64; use 128"),
    ({"workload": {"length_scale": 1.0}},
     r"longest request has \d+ tokens \(prompt \+ output\), beyond model.max_position=4096"),
    ({"mesh": {"tp": 3}}, r"mesh.tp=3 does not divide model.num_heads=4"),
    ({"memory": {"system": "hisparse", "hisparse": {"device_buffer_size": 4}}},
     r"memory.hisparse.device_buffer_size=4 is smaller than top-k=8"),
    ({"memory": {"system": "ula", "device_pool": 4}},
     r"memory.device_pool=4 holds 4 tokens per device, fewer than one decode step needs on "
     r"the device: engine.max_batch \* \(top-k \+ 1\) = 8 \* \(8 \+ 1\) = 72"),
    ({"memory": {"system": "ula", "device_pool": "1KiB"}},
     # tiny: 4 layers x 48 values x 4 bytes = 768 bytes per token
     r"memory.device_pool='1KiB' holds 1 tokens per device"),
    ({"memory": {"system": "ula", "local_buffer": 4}, "mesh": {"tp": 2}},
     r"memory.local_buffer=4 is smaller than one decode step's selection: "
     r"engine.max_batch \* \(top-k \+ 1\) = 72"),
    ({"memory": {"system": "ula", "layout": "replicated"}, "mesh": {"tp": 2}},
     r"memory.layout='replicated' is resident's TP layout"),
])
def test_impossible_combinations_are_rejected(sections, match):
  with pytest.raises(ConfigError, match=match):
    cfg_of(**sections)


def test_combination_checks_pass_where_they_should():
  cfg_of(memory={"system": "ula", "device_pool": 128, "local_buffer": 72}, mesh={"tp": 2})
  cfg_of(memory={"system": "ula", "device_pool": 72})
  cfg_of(memory={"system": "hisparse", "hisparse": {"device_buffer_size": 8}})
  # Single-device ula ignores the TP local buffer.
  cfg_of(memory={"system": "ula", "local_buffer": 4})


# ----------------------------------------------------------------------------------
# composition and overrides
# ----------------------------------------------------------------------------------


def test_overrides_are_yaml_values_applied_last(tmp_path):
  cfg = load_config(QUICKSTART, ["engine.max_batch=3", "workload.prompt_len=[1000,2000]",
                                 "memory.device_pool=8GiB", "memory.system=ula",
                                 "experiment.description=hello world"])
  assert cfg.engine.max_batch == 3
  assert cfg.workload.prompt_len == (1000, 2000)
  assert cfg.memory.device_pool == "8GiB" and cfg.memory.system == "ula"
  assert cfg.experiment.description == "hello world"


def test_section_override_swaps_a_building_block():
  cfg = load_config(QUICKSTART, ["memory=hisparse", "memory.hisparse.device_buffer_size=64"])
  assert cfg.memory.system == "hisparse"
  assert cfg.memory.hisparse.device_buffer_size == 64
  blocks, dotted = parse_overrides(["memory=ula_lru", "mesh.dp=2"])
  assert blocks == {"memory": "ula_lru"} and dotted == ["mesh.dp=2"]


def test_experiment_file_overrides_blocks_and_interpolates(tmp_path):
  path = write(tmp_path, """
defaults: {model: tiny, memory: ula_pb_lru, mesh: dp1, workload: summarization_small}
memory: {device_pool: "${engine.max_context}"}
engine: {max_context: 384, page_size: 64}
""")
  cfg = load_config(path)
  assert cfg.memory.system == "ula" and cfg.memory.policy == "pb_lru"
  assert cfg.memory.device_pool == 384
  assert cfg.experiment.name == "exp"  # from the file name


def test_blocks_are_found_next_to_the_experiment(tmp_path):
  (tmp_path / "memory").mkdir()
  (tmp_path / "memory" / "mine.yaml").write_text("system: ula\npolicy: lru\n")
  (tmp_path / "experiments").mkdir()
  path = write(tmp_path / "experiments", "defaults: {memory: mine, model: tiny}\n"
               "workload: {length_scale: 0.001}\n")
  cfg = load_config(path)
  assert cfg.memory.policy == "lru"
  # A block file given by path, relative to the experiment file.
  other = write(tmp_path, "defaults: {memory: memory/mine.yaml, model: tiny}\n"
                "workload: {length_scale: 0.001}\n", "other.yaml")
  assert load_config(other).memory.system == "ula"


@pytest.mark.parametrize("text,overrides,match", [
    ("defaults: {memory: ula_pb_lur}", [],
     r"defaults.memory='ula_pb_lur': no building block of that name \(did you mean 'ula_pb_lru'"),
    ("defaults: {memroy: resident}", [],
     r"defaults.memroy: not a section with building blocks \(did you mean 'memory'"),
    ("defaults: [tiny]", [], r"defaults=\['tiny'\]: expected a mapping"),
    ("defaults: {model: 3}", [], r"defaults.model=3: expected a building block name"),
    ("defaults: {memory: nothere.yaml}", [], r"defaults.memory='nothere.yaml': no such file"),
    ("- 1\n- 2\n", [], r"expected a mapping of sections at the top level, got a list"),
    ("a: [1, 2\n", [], r"not valid YAML"),
    ("engine: {max_batch: '${nope}'}", [], r"cannot compose the config"),
    ("experiment: {name: x}", ["engine.max_batch"],
     r"override 'engine.max_batch': expected key=value"),
    ("experiment: {name: x}", ["=3"], r"override '=3': expected key=value"),
])
def test_composition_errors(tmp_path, text, overrides, match):
  path = write(tmp_path, text)
  with pytest.raises(ConfigError, match=match):
    load_config(path, overrides)


def test_missing_config_file(tmp_path):
  with pytest.raises(ConfigError, match=r"config file not found: .*nope.yaml"):
    load_config(tmp_path / "nope.yaml")


def test_compose_returns_the_merged_plain_dict():
  data = compose(QUICKSTART, ["mesh.dp=2"])
  assert data["mesh"] == {"dp": 2, "tp": 1, "platform": "cpu"}
  assert data["model"] == {"preset": "tiny"}
  assert "defaults" not in data


def test_config_to_yaml_lists_every_section_and_round_trips(tmp_path):
  cfg = load_config(QUICKSTART, ["memory=hisparse", "memory.hisparse.top_k=8"])
  text = config_to_yaml(cfg)
  doc = yaml.safe_load(text)
  assert list(doc) == ["experiment", "model", "memory", "mesh", "workload", "engine", "kernels",
                       "speculative"]
  assert "prompt_len: [65536, 131072]" in text
  assert load_config(write(tmp_path, text)) == cfg


# ----------------------------------------------------------------------------------
# devices and mesh
# ----------------------------------------------------------------------------------


def test_check_devices():
  cfg = cfg_of(mesh={"dp": 2, "tp": 4})
  check_devices(cfg, 8)
  with pytest.raises(ConfigError, match=r"mesh.dp\*mesh.tp = 2\*4 = 8 devices, but only 4 "
                     r"gpu device\(s\) exist; lower mesh.dp or mesh.tp"):
    check_devices(cfg, 4, "gpu")


def test_build_mesh_on_simulated_devices():
  cfg = cfg_of(mesh={"dp": 2, "tp": 4, "platform": "cpu"})
  configure_platform(cfg)  # the backend is already up with 8 devices: nothing changes
  mesh = build_mesh(cfg)
  assert mesh.axis_names == ("dp", "tp")
  assert dict(mesh.shape) == {"dp": 2, "tp": 4}
  assert list(mesh.devices.flat) == jax.devices("cpu")[:8]
  small = build_mesh(cfg_of(mesh={"dp": 3, "platform": "cpu"}))
  assert dict(small.shape) == {"dp": 3, "tp": 1}


def test_gpu_memory_fraction_is_set_unless_the_environment_sets_it(monkeypatch):
  from ula_jax.core.host_memory import HOST_LIMIT_ENV
  from ula_jax.mesh import MEM_FRACTION_ENV
  for var in (*MEM_FRACTION_ENV, "XLA_FLAGS", HOST_LIMIT_ENV):
    monkeypatch.delenv(var, raising=False)
  configure_platform(cfg_of(mesh={"platform": "auto", "gpu_memory_fraction": 0.9}))
  assert os.environ["XLA_CLIENT_MEM_FRACTION"] == "0.9"
  monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION")
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # the user's, older name
  configure_platform(cfg_of(mesh={"platform": "auto"}))
  assert "XLA_CLIENT_MEM_FRACTION" not in os.environ
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
  configure_platform(cfg_of(mesh={"platform": "cpu"}))  # no GPU backend: nothing to set
  configure_platform(cfg_of(mesh={"platform": "auto", "gpu_memory_fraction": None}))
  assert not any(v in os.environ for v in MEM_FRACTION_ENV)
  with pytest.raises(ConfigError, match="mesh.gpu_memory_fraction"):
    cfg_of(mesh={"gpu_memory_fraction": 1.5})


def test_build_mesh_rejects_more_devices_than_exist():
  cfg = cfg_of(mesh={"dp": 4, "tp": 4, "platform": "cpu"})
  with pytest.raises(ConfigError, match=r"= 16 devices, but only 8 cpu device\(s\) exist"):
    build_mesh(cfg)


def test_pallas_on_cpu_needs_interpret_mode():
  cfg = cfg_of(kernels={"attention": "pallas", "interpret": False})
  with pytest.raises(ConfigError, match=r"kernels.interpret=false with kernels.attention=pallas "
                     r"on CPU"):
    check_kernels(cfg, "cpu")
  check_kernels(cfg, "gpu")
  assert interpret_kernels(cfg_of(), "cpu") and not interpret_kernels(cfg_of(), "gpu")
  assert not interpret_kernels(cfg, "cpu")


def test_readme_documents_every_field():
  readme = (REPO_CONFIGS.parent / "README.md").read_text()
  sections = {"memory": MemoryConfig, "memory.hisparse": HiSparseConfig,
              "memory.far_tier": FarTierConfig, "mesh": MeshConfig, "workload": WorkloadConfig,
              "engine": EngineConfig, "kernels": KernelsConfig, "experiment": ExperimentInfo,
              "model": ModelConfig}
  missing = [f"{prefix}.{name}" for prefix, cls in sections.items() for name in cls.model_fields
             if f"`{prefix}.{name}`" not in readme and name not in ("hisparse", "far_tier")]
  assert missing == []


def test_context_buckets_are_few_and_at_most_a_quarter_over():
  from ula_jax.config.schema import context_bucket

  assert context_bucket(107, 16) == 112  # up to 8 pages: every page count
  assert [context_bucket(n, 64) for n in (1, 64, 65, 512, 513)] == [64, 64, 128, 512, 640]
  sizes = {context_bucket(n, 64) for n in range(65536, 131073, 97)}
  assert sizes == {65536, 81920, 98304, 114688, 131072}  # 64K-128K: five programs
  for n in range(1, 300000, 613):
    b = context_bucket(n, 64)
    assert n <= b <= max(-(-n // 64) * 64 * 1.25, 8 * 64)
