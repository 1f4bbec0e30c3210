"""What every experiment shares: its record, its per-scale parameters, its outcome, and
the run directory it writes.

An experiment answers one question of the papers (UlaCache, HiSparse, SAC) with one
command, ``ula-jax experiment NAME [--scale cpu|gpu] [a.b=v ...]``. Its parameters live
in ``experiments/NAME/experiment.yaml``, one section per scale::

    cpu:            # simulated CPU devices, small sizes: seconds
      contexts: [256, 512]
    gpu:            # one H200
      contexts: [16384, 131072]

The section of the chosen scale, with the command line's dotted overrides merged in,
is validated by the experiment's ``params`` model (a frozen pydantic ``Section``:
unknown keys are refused with the closest valid names). ``run(params, ctx)`` computes
an ``Outcome``: table rows, the data behind the figure, the checks the experiment
claims (invariants that must hold at any scale), and the anchor's numbers beside ours.
``write_outcome`` puts ``figure.png``, ``table.md``, ``results.json`` and
``params.yaml`` into a run directory that is never half written (``RunDirTarget``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError

from ula_jax.config import ConfigError, parse_value, split_override
from ula_jax.config.errors import format_validation_error, suggest
from ula_jax.config.schema import Section
from ula_jax.core.serialize import dumps

SCALES = ("cpu", "gpu")
REPO_ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS_DIR = REPO_ROOT / "experiments"
PARAMS_FILE = "experiment.yaml"
FIGURE, TABLE, RESULTS, PARAMS = "figure.png", "table.md", "results.json", "params.yaml"


class Params(Section):
  """Base of every experiment's parameters (frozen, unknown keys refused)."""


@dataclasses.dataclass(frozen=True)
class Check:
  """An invariant the experiment claims, and whether this run's numbers obey it."""

  name: str
  holds: bool
  detail: str


@dataclasses.dataclass(frozen=True)
class AnchorPoint:
  """One of the anchor's numbers beside ours (``anchor`` None: the anchor gives none)."""

  what: str
  ours: float | None
  anchor: float | None
  source: str  # "UlaCache", "HiSparse", "SAC"; "" for a point of ours alone


@dataclasses.dataclass
class Outcome:
  """What one experiment computed.

  title:   the table's title
  columns: the table's columns, in order (keys of ``rows``)
  rows:    one dict per table row (also in ``results.json``)
  data:    everything else ``results.json`` keeps (the figure is drawn from it)
  checks:  the invariants claimed
  anchor:  the anchor's numbers beside ours
  draw:    ``draw(fig)`` fills a matplotlib Figure
  notes:   lines printed under the table (and kept in the JSON)
  figsize: the figure's (width, height) in inches
  """

  title: str
  columns: list[str]
  rows: list[dict]
  data: dict
  checks: list[Check]
  anchor: list[AnchorPoint]
  draw: Callable[[Any], None]
  notes: list[str] = dataclasses.field(default_factory=list)
  figsize: tuple[float, float] = (13, 4.8)

  @property
  def ok(self) -> bool:
    return all(c.holds for c in self.checks)


@dataclasses.dataclass
class Context:
  """What a running experiment may use: its scale, a scratch folder inside the run
  directory being written, and a line printer."""

  name: str
  scale: str
  work_dir: Path
  log: Callable[[str], None] = print
  progress: bool = True


@dataclasses.dataclass(frozen=True)
class Experiment:
  """One question as an experiment.

  question: what it asks, one sentence
  anchor:   the anchor paper's claim it is measured against
  params:   the per-scale parameter model
  run:      ``run(params, ctx) -> Outcome``
  devices:  ``devices(params) -> (platform, devices)`` the backend must start with
  """

  name: str
  question: str
  anchor: str
  params: type[Params]
  run: Callable[[Any, Context], Outcome]
  devices: Callable[[Any], tuple[str, int]]

  @property
  def folder(self) -> Path:
    return EXPERIMENTS_DIR / self.name

  def command(self, scale: str = "cpu") -> str:
    return f"ula-jax experiment {self.name} --scale {scale}"


# ----------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------


def load_params(exp: Experiment, scale: str, overrides: Sequence[str] = (),
                path: str | Path | None = None) -> Params:
  """The parameters of ``exp`` at ``scale``: the file's section (``path``, default
  ``experiments/NAME/experiment.yaml``) with ``a.b=v`` overrides, validated.
  ConfigError names the file, the field, its value and what is valid."""
  path = Path(path) if path is not None else exp.folder / PARAMS_FILE
  source = str(path)
  if scale not in SCALES:
    raise ConfigError([f"--scale {scale!r}: expected one of {', '.join(SCALES)}"])
  if not path.is_file():
    raise ConfigError([f"experiment {exp.name!r}: parameter file not found: {path}"])
  try:
    conf = OmegaConf.load(path)
  except (yaml.YAMLError, OmegaConfBaseException) as e:
    raise ConfigError([f"not valid YAML: {e}"], source=source) from None
  data = OmegaConf.to_container(conf, resolve=True)
  if not isinstance(data, dict):
    raise ConfigError([f"expected a mapping with the sections {', '.join(SCALES)}"],
                      source=source)
  unknown = [k for k in data if k not in SCALES]
  if unknown:
    raise ConfigError([f"unknown section {k!r}{suggest(str(k), SCALES)}; the sections are "
                       f"the scales: {', '.join(SCALES)}" for k in unknown], source=source)
  if not isinstance(data.get(scale), dict):
    raise ConfigError([f"no section {scale!r} (a mapping of {exp.name}'s parameters); "
                       f"the file has {', '.join(data) or 'none'}"], source=source)
  section = OmegaConf.create(data[scale])
  problems = []
  for item in overrides:
    key, value = split_override(item)
    try:
      OmegaConf.update(section, key, parse_value(value), merge=True, force_add=True)
    except OmegaConfBaseException as e:
      problems.append(f"override {item!r}: {e}")
  if problems:
    raise ConfigError(problems, source=source)
  try:
    return exp.params.model_validate(OmegaConf.to_container(section, resolve=True))
  except ValidationError as e:
    raise ConfigError(format_validation_error(e, exp.params),
                      source=f"{source}, section {scale}") from None


def repo_path(path: str | Path) -> Path:
  """A file a parameter names: as given when it exists from the working directory,
  else relative to the repository (so experiments run from any directory)."""
  p = Path(path)
  if p.is_absolute() or p.exists():
    return p
  return REPO_ROOT / p


def configure_backend(platform: str, devices: int) -> None:
  """Starts jax's backend the way a run does (``mesh.configure_platform``): ``devices``
  simulated CPU devices on ``cpu``, the persistent compilation cache on (one already
  set, as the test suite's, is kept). Call before the first array is made."""
  import jax

  from ula_jax.config import load_config
  from ula_jax.mesh import configure_platform

  over = [f"mesh.platform={platform}", f"mesh.dp={devices}", "mesh.tp=1"]
  if jax.config.jax_compilation_cache_dir:
    over.append(f"engine.compilation_cache_dir={jax.config.jax_compilation_cache_dir}")
  configure_platform(load_config(EXPERIMENTS_DIR / "quickstart" / "config.yaml", over))


def cache_overrides() -> list[str]:
  """Config overrides that keep the engine's runs on the compilation cache already set
  (the test suite's session cache, or the one ``configure_backend`` turned on)."""
  import jax

  d = jax.config.jax_compilation_cache_dir
  return [f"engine.compilation_cache_dir={d}"] if d else []


# ----------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------


def fmt(value: Any) -> str:
  """A table cell: ints with separators, fractions to 3 digits, others to 3 significant."""
  if value is None:
    return "-"
  if isinstance(value, bool):
    return "yes" if value else "no"
  if isinstance(value, int):
    return f"{value:,}"
  if isinstance(value, float):
    if math.isnan(value):
      return "-"
    if value == 0:
      return "0"
    if abs(value) >= 1000:
      return f"{value:,.0f}"
    if abs(value) >= 100:
      return f"{value:.1f}"
    return f"{value:.3g}"
  return str(value)


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def markdown_table(columns: Sequence[str], rows: Sequence[dict]) -> str:
  head = "| " + " | ".join(map(_cell, columns)) + " |"
  rule = "|" + "|".join("---" for _ in columns) + "|"
  body = ["| " + " | ".join(_cell(fmt(r.get(c))) for c in columns) + " |" for r in rows]
  return "\n".join([head, rule, *body])


def rich_table(title: str, columns: Sequence[str], rows: Sequence[dict]):
  from rich.markup import escape
  from rich.table import Table

  table = Table(title=escape(title))
  for i, c in enumerate(columns):
    table.add_column(escape(c), justify="left" if i == 0 else "right")
  for r in rows:
    table.add_row(*(escape(fmt(r.get(c))) for c in columns))
  return table


def machine() -> dict:
  """Where and when: backend, device kind and count, CPU cores, jax, Python, UTC date."""
  import datetime
  import platform

  import jax

  devs = jax.devices()
  return {"backend": jax.default_backend(),
          "device": getattr(devs[0], "device_kind", str(devs[0])), "devices": len(devs),
          "cpu_cores": os.cpu_count(), "jax": jax.__version__,
          "python": platform.python_version(),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def machine_line(m: dict) -> str:
  n = m["devices"]
  where = (f"{m['cpu_cores']}-core CPU, {n} simulated device{'s' if n > 1 else ''}"
           if m["backend"] == "cpu" else f"{m['devices']} x {m['device']}")
  return f"{where}, jax {m['jax']}, {m['date'][:10]}"


def anchor_panel(ax, points: Sequence[AnchorPoint]) -> None:
  """Ours beside the anchor's number, one pair of bars per point (each pair normalised
  to the larger of the two, the values written on the bars)."""
  shown = [p for p in points if p.ours is not None or p.anchor is not None]
  if not shown:
    ax.set_axis_off()
    return
  y = range(len(shown))
  for i, p in enumerate(shown):
    top = max(abs(v) for v in (p.ours, p.anchor) if v is not None) or 1.0
    for dy, value, color, label in ((-0.18, p.ours, "tab:blue", "ours"),
                                    (0.18, p.anchor, "tab:gray", "anchor")):
      if value is None:
        ax.text(0.02, i + dy, f"{label}: -", va="center", fontsize="small")
        continue
      ax.barh(i + dy, value / top, height=0.34, color=color,
              label=label if i == 0 else None)
      ax.text(value / top + 0.02, i + dy, f"{label} {fmt(float(value))}", va="center",
              fontsize="small")
  ax.set_yticks(list(y), [_wrap(f"{p.what} ({p.source})" if p.source else p.what)
                          for p in shown], fontsize="small")
  ax.set_xlim(0, 1.9)
  ax.set_ylim(len(shown) - 0.5, -0.5)
  ax.set_xticks([])
  ax.set_title("ours beside the anchor", fontsize="medium")
  ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2,
            frameon=False)


def _wrap(text: str, width: int = 28) -> str:
  import textwrap
  return "\n".join(textwrap.wrap(text, width))


def save_figure(outcome: Outcome, path: Path) -> Path:
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=outcome.figsize)
  FigureCanvasAgg(fig)
  outcome.draw(fig)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return path


def write_outcome(run_dir: Path, exp: Experiment, scale: str, params: Params,
                  outcome: Outcome, env: dict, seconds: float) -> None:
  """figure.png, table.md, results.json and params.yaml into ``run_dir``."""
  save_figure(outcome, run_dir / FIGURE)
  lines = [f"# {exp.name} ({scale})", "", f"**Question.** {exp.question}", "",
           f"**Anchor.** {exp.anchor}", "", f"`{exp.command(scale)}` on "
           f"{machine_line(env)} ({seconds:.0f} s).", "", f"{outcome.title}:", "",
           markdown_table(outcome.columns, outcome.rows), ""]
  if outcome.anchor:
    lines += ["| ours beside the anchor | ours | anchor |", "|---|---|---|"]
    lines += [f"| {_cell(p.what)}{f' ({_cell(p.source)})' if p.source else ''} | "
              f"{fmt(p.ours)} | {fmt(p.anchor)} |"
              for p in outcome.anchor]
    lines.append("")
  lines += [f"- check: {c.name}: {'holds' if c.holds else 'FAILS'} ({c.detail})"
            for c in outcome.checks]
  lines += [f"- {n}" for n in outcome.notes]
  (run_dir / TABLE).write_text("\n".join(lines) + "\n")
  (run_dir / PARAMS).write_text(yaml.safe_dump(
      {"experiment": exp.name, "scale": scale, "params": params.model_dump(mode="json")},
      sort_keys=False))
  (run_dir / RESULTS).write_text(dumps({
      "experiment": exp.name, "question": exp.question, "anchor_claim": exp.anchor,
      "scale": scale, "params": params.model_dump(mode="json"), "environment": env,
      "wall_s": seconds, "title": outcome.title, "columns": outcome.columns,
      "rows": outcome.rows, "anchor": [dataclasses.asdict(p) for p in outcome.anchor],
      "checks": [dataclasses.asdict(c) for c in outcome.checks], "ok": outcome.ok,
      "notes": outcome.notes, "data": outcome.data}, indent=1) + "\n")


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
  t0 = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t0
