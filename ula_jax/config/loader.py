"""Loading, composing and overriding experiment configs (OmegaConf), validated by the
schema (pydantic).

An experiment file names building blocks in a ``defaults`` mapping and then sets any
field::

    defaults: {model: tiny, memory: resident, mesh: dp8, workload: summarization_small}
    workload: {num_requests: 16}
    experiment: {name: quickstart}

``configs/<section>/<name>.yaml`` holds the body of one section. Merge order: the
building blocks, then the experiment file, then command-line overrides. An override is
``a.b=value`` (the value parsed as YAML) or ``<section>=<block name>`` to swap a block.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError

from ula_jax.config.errors import ConfigError, format_validation_error, suggest
from ula_jax.config.schema import BLOCK_SECTIONS, ExperimentConfig

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"
"""The building blocks shipped with the project (used when an experiment file lives
outside a ``configs`` tree)."""

_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


# ----------------------------------------------------------------------------------
# overrides
# ----------------------------------------------------------------------------------


def split_override(item: str) -> tuple[str, str]:
  """``'a.b=value'`` -> ``('a.b', 'value')`` (the value still unparsed)."""
  key, sep, value = item.partition("=")
  key = key.strip()
  if not sep or not _KEY.fullmatch(key):
    raise ConfigError([f"override {item!r}: expected key=value with a dotted key, "
                       f"e.g. memory.system=ula or workload.prompt_len=[128,256]"])
  return key, value


def parse_value(text: str) -> Any:
  """A command-line value, parsed as YAML (``4`` -> int, ``[1,2]`` -> list, ``8GiB`` -> str)."""
  try:
    return yaml.safe_load(text) if text.strip() else None
  except yaml.YAMLError:
    return text


def parse_overrides(overrides: Sequence[str]) -> tuple[dict[str, str], list[str]]:
  """Splits overrides into block swaps (``memory=ula_pb_lru``) and dotted ``a.b=v`` items."""
  blocks: dict[str, str] = {}
  dotted: list[str] = []
  for item in overrides:
    key, value = split_override(item)
    if "." not in key and key in BLOCK_SECTIONS and isinstance(parse_value(value), str):
      blocks[key] = parse_value(value)
    else:
      dotted.append(f"{key}={value}")
  return blocks, dotted


# ----------------------------------------------------------------------------------
# files and building blocks
# ----------------------------------------------------------------------------------


def _load_yaml(path: Path) -> DictConfig:
  if not path.is_file():
    raise ConfigError([f"config file not found: {path}"])
  try:
    conf = OmegaConf.load(path)
  except (yaml.YAMLError, OmegaConfBaseException) as e:
    raise ConfigError([f"{path}: not valid YAML: {e}"]) from None
  if not isinstance(conf, DictConfig):
    raise ConfigError([f"{path}: expected a mapping of sections at the top level, "
                       f"got a {type(OmegaConf.to_container(conf)).__name__}"])
  return conf


def block_roots(exp_path: Path) -> list[Path]:
  """Directories searched for ``<section>/<name>.yaml``: the nearest ``configs``-like
  tree above the experiment file, then the project's own ``configs/``."""
  roots = []
  exp_dir = exp_path.resolve().parent
  for d in [exp_dir, *exp_dir.parents][:3]:
    if any((d / s).is_dir() for s in BLOCK_SECTIONS):
      roots.append(d)
      break
  if REPO_CONFIGS.is_dir() and REPO_CONFIGS not in roots:
    roots.append(REPO_CONFIGS)
  return roots


def block_names(section: str, roots: Sequence[Path]) -> list[str]:
  """Names of the building blocks of ``section`` found under ``roots``."""
  names = {p.stem for r in roots for p in (r / section).glob("*.yaml")}
  return sorted(names)


def find_block(section: str, name: str, exp_path: Path) -> Path:
  """The file of building block ``name`` of ``section`` (a name, or a path to a YAML file
  relative to the experiment file)."""
  if name.endswith((".yaml", ".yml")):
    path = (exp_path.parent / name).resolve()
    if not path.is_file():
      raise ConfigError([f"defaults.{section}={name!r}: no such file {path}"])
    return path
  roots = block_roots(exp_path)
  for root in roots:
    path = root / section / f"{name}.yaml"
    if path.is_file():
      return path
  names = block_names(section, roots)
  raise ConfigError([f"defaults.{section}={name!r}: no building block of that name"
                     f"{suggest(name, names)}; available: {', '.join(names) or 'none'} "
                     f"(searched {', '.join(str(r / section) for r in roots)})"])


# ----------------------------------------------------------------------------------
# composition and validation
# ----------------------------------------------------------------------------------


def compose(path: str | Path, overrides: Sequence[str] = ()) -> dict:
  """The merged, interpolation-resolved plain dict (not validated)."""
  try:
    return _compose(Path(path), overrides)
  except ConfigError as e:
    if e.source is None:
      raise ConfigError(e.problems, source=str(path)) from None
    raise


def _compose(path: Path, overrides: Sequence[str]) -> dict:
  conf = _load_yaml(path)
  blocks, dotted = parse_overrides(overrides)

  defaults = conf.pop("defaults", None)
  defaults = OmegaConf.to_container(defaults) if defaults is not None else {}
  if not isinstance(defaults, dict):
    raise ConfigError([f"{path}: defaults={defaults!r}: expected a mapping section -> "
                       f"building block name, e.g. {{model: tiny, memory: resident}}"])
  problems = []
  for section in [*defaults, *blocks]:
    if section not in BLOCK_SECTIONS:
      problems.append(f"defaults.{section}: not a section with building blocks"
                      f"{suggest(str(section), BLOCK_SECTIONS)}; sections: "
                      f"{', '.join(BLOCK_SECTIONS)}")
  if problems:
    raise ConfigError(problems, source=str(path))
  defaults.update(blocks)

  layers = []
  for section, name in defaults.items():
    if name is None:
      continue
    if not isinstance(name, str):
      raise ConfigError([f"defaults.{section}={name!r}: expected a building block name"],
                        source=str(path))
    layers.append(OmegaConf.create({section: _load_yaml(find_block(section, name, path))}))
  layers.append(conf)
  try:
    layers.append(OmegaConf.from_dotlist(dotted))
    merged = OmegaConf.merge(*layers)
    data = OmegaConf.to_container(merged, resolve=True)
  except OmegaConfBaseException as e:
    raise ConfigError([f"cannot compose the config: {e}"], source=str(path)) from None

  experiment = data.setdefault("experiment", {})
  if isinstance(experiment, dict) and experiment.get("name") is None:
    # experiments/<name>/config.yaml is named after its folder.
    experiment["name"] = path.parent.name if path.stem == "config" else path.stem
  return data


def validate(data: dict, source: str | None = None,
             memory_fields_set: set[str] | None = None) -> ExperimentConfig:
  """A plain dict -> ExperimentConfig, or one ConfigError listing every problem.

  memory_fields_set: dotted names below ``memory`` that count as set by the user for the
  check that the chosen memory system reads them; None = every memory field ``data`` gives.
  """
  try:
    return ExperimentConfig.model_validate(
        data, context={"memory_fields_set": memory_fields_set})
  except ValidationError as e:
    raise ConfigError(format_validation_error(e, ExperimentConfig), source=source) from None


def _leaf_paths(value: Any, prefix: str = "") -> set[str]:
  """Dotted paths of the non-mapping values of a nested dict."""
  if not isinstance(value, dict):
    return {prefix} if prefix else set()
  out: set[str] = set()
  for k, v in value.items():
    out |= _leaf_paths(v, f"{prefix}.{k}" if prefix else str(k))
  return out


def override_memory_fields(overrides: Sequence[str]) -> set[str]:
  """Dotted names below ``memory`` that ``overrides`` set (``memory.host_pool=8GiB`` ->
  ``{'host_pool'}``); block swaps (``memory=ula_lru``) set none."""
  _, dotted = parse_overrides(overrides)
  try:
    data = OmegaConf.to_container(OmegaConf.from_dotlist(dotted))
  except OmegaConfBaseException:
    return set()  # compose reports it
  return _leaf_paths(data.get("memory") or {})


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
  """Loads an experiment file, composes its building blocks, applies ``overrides``
  (``'a.b=value'`` strings) and validates everything (no compute).

  A memory field the chosen ``memory.system`` never reads is an error when an override
  sets it: experiment files and building blocks may hold the fields of several systems
  (a sweep over ``memory=resident,ula_pb_lru`` shares them), so their fields do not count.
  """
  data = compose(path, overrides)
  return validate(data, source=str(path), memory_fields_set=override_memory_fields(overrides))


def config_to_yaml(cfg: ExperimentConfig) -> str:
  """The resolved config as YAML (``load_config`` of it gives ``cfg`` back)."""
  data = cfg.model_dump(mode="json")
  ordered = {"experiment": data.pop("experiment"), **data}
  return yaml.dump(ordered, Dumper=_Dumper, sort_keys=False, width=100)


class _Dumper(yaml.SafeDumper):
  """Block mappings, flow lists (``prompt_len: [65536, 131072]``)."""


_Dumper.add_representer(
    list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def check_devices(cfg: ExperimentConfig, available: int, platform: str | None = None) -> None:
  """Raises ConfigError when the mesh needs more devices than ``available``."""
  need = cfg.mesh.num_devices
  if need > available:
    what = f"{platform} device(s)" if platform else "device(s)"
    hint = (" (on CPU, mesh.platform=cpu simulates as many devices as the mesh needs "
            "when set before jax starts)" if platform in (None, "cpu") else "")
    raise ConfigError([f"mesh.dp*mesh.tp = {cfg.mesh.dp}*{cfg.mesh.tp} = {need} devices, "
                       f"but only {available} {what} exist; lower mesh.dp or mesh.tp{hint}"])
