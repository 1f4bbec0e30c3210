"""The ``ula-jax trace`` verb: ``stats`` (locality statistics of a trace), ``generate`` (a
synthetic trace with stated locality) and ``import`` (SGLang's indexer top-k arrays).
Replaying a trace through a memory system is ``ula-jax run`` with ``workload.kind:
trace``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ula_jax.cli.common import EXIT_OK, EXIT_USAGE, console


def _model_geometry(spec: str, *, groups: int | None = None, top_k: int | None = None):
  """``--model``: a preset name (glm5, dsv32, small, tiny) or a YAML file of the model
  section (``configs/model/glm5.yaml``) -> its KV geometry."""
  import yaml

  from ula_jax.config.errors import ConfigError
  from ula_jax.models.config import ModelConfig

  path = Path(spec)
  if path.suffix in (".yaml", ".yml"):
    try:
      fields = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
      raise ConfigError([f"--model {spec}: cannot read it: {e}"]) from None
  else:
    fields = {"preset": spec}
  if top_k is not None:
    fields["index_topk"] = top_k
  try:
    model = ModelConfig.model_validate(fields)
    if groups is not None:
      layers = groups * model.index_share
      model = ModelConfig.model_validate({**fields, "num_layers": layers,
                                          "num_dense_layers": min(model.num_dense_layers,
                                                                  layers - 1)})
  except ValueError as e:
    raise ConfigError([f"--model {spec}: {e}"]) from None
  return model.kv_geometry()


def _range(text: str, flag: str) -> tuple[int, int]:
  """``'500'`` or ``'400-600'`` -> (min, max)."""
  try:
    parts = [int(x) for x in text.split("-")]
  except ValueError:
    parts = []
  if len(parts) == 1:
    parts *= 2
  if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
    raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected N or MIN-MAX with "
                                     f"1 <= MIN <= MAX")
  return parts[0], parts[1]


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
  sub = p.add_subparsers(dest="trace_verb", required=True, metavar="{stats,generate,import}")

  s = sub.add_parser("stats", help="locality statistics of a trace: consecutive-step overlap, "
                     "reuse distances, per-request LRU buffer and shared-pool miss rates")
  s.add_argument("trace", metavar="TRACE",
                 help="a trace (.npz or trace directory) or a run directory recorded with "
                 "engine.record_trace")
  s.add_argument("--json", metavar="OUT", help="write the statistics as JSON")
  s.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
  s.add_argument("--max-selections", type=int, default=None, metavar="N",
                 help="measure the per-request statistics on a sample of rows when a trace "
                 "has more selection slots than N (default 2^28); 0 = every row")
  pool = s.add_mutually_exclusive_group()
  pool.add_argument("--pool", dest="pool", action="store_const", const=True,
                    help="replay the shared ula pool (pb_lru, lru) at the buffers' memory "
                    "(default: when the trace has at most 2^26 selection slots)")
  pool.add_argument("--no-pool", dest="pool", action="store_const", const=False,
                    help="skip the shared-pool replays")
  s.add_argument("--seed", type=int, default=0, help="seed of the row sample")

  g = sub.add_parser("generate", help="a synthetic trace with stated locality")
  g.add_argument("--out", required=True, metavar="PATH",
                 help="PATH.npz, or a directory (memory-mapped .npy files: large traces)")
  g.add_argument("--model", default="glm5",
                 help="the model whose KV geometry the trace has: a preset (glm5, dsv32, "
                 "small, tiny) or a model YAML (default glm5)")
  g.add_argument("--groups", type=int, help="layer groups (default: the model's)")
  g.add_argument("--topk", type=int, help="entries selected per step (default: the model's)")
  g.add_argument("--requests", type=int, default=64)
  g.add_argument("--steps", default="500", help="decode steps per request: N or MIN-MAX")
  g.add_argument("--context", default="65536-131072",
                 help="prompt tokens per request: N or MIN-MAX (uniform)")
  g.add_argument("--batch", type=int, default=None,
                 help="rows of the rank (default: every request at once, at most 64)")
  g.add_argument("--overlap", type=float, default=0.7,
                 help="chance that an entry of a group's last selection is selected again")
  g.add_argument("--group-share", type=float, default=0.3,
                 help="chance that an entry the group below selects (and this group did not "
                 "last step) is selected too")
  g.add_argument("--recency", type=float, default=1.0,
                 help="fresh positions are d back from the new token with P ~ d^-recency")
  g.add_argument("--page-size", type=int, default=64)
  g.add_argument("--prefill-chunk", type=int, default=8192,
                 help="prompt addresses per prefill event")
  g.add_argument("--seed", type=int, default=0)

  i = sub.add_parser("import", help="SGLang indexer_topk arrays (a directory with "
                     "manifest.json) -> a trace")
  i.add_argument("src", metavar="SRC", help="a directory holding manifest.json, or the manifest")
  i.add_argument("--out", required=True, metavar="PATH", help="PATH.npz or a directory")
  i.add_argument("--model", default="glm5", help="the model the arrays come from (preset or "
                 "model YAML; its index_topk must be the arrays' k)")
  i.add_argument("--batch", type=int, default=None,
                 help="rows of the rank (default: every request at once, at most 64)")
  i.add_argument("--layers", default=None,
                 help="the indexer layer of each layer group, comma-separated (default: the "
                 "manifest's, else one layer per group or the first layer of each group)")
  i.add_argument("--page-size", type=int, default=64)
  i.add_argument("--prefill-chunk", type=int, default=8192)


def run_trace(args: argparse.Namespace) -> int:
  from ula_jax.config.errors import ConfigError
  from ula_jax.memory.traces.format import TraceError

  try:
    return {"stats": _stats, "generate": _generate, "import": _import}[args.trace_verb](args)
  except argparse.ArgumentTypeError as e:
    print(f"error: ula-jax trace {args.trace_verb}: {e}", file=sys.stderr)
    return EXIT_USAGE
  except TraceError as e:
    raise ConfigError([str(e)]) from None
  except ValueError as e:
    if isinstance(e, ConfigError):
      raise
    raise ConfigError([f"ula-jax trace {args.trace_verb}: {e}"]) from None


def _stats(args: argparse.Namespace) -> int:
  from ula_jax.memory.traces.format import load_traces
  from ula_jax.memory.traces.stats import MAX_SELECTIONS, locality_stats
  from ula_jax.report.locality import locality_tables, plot_locality
  from ula_jax.report.output import dumps

  traces = load_traces(args.trace)
  for t in traces:
    t.validate()
  budget = MAX_SELECTIONS if args.max_selections is None else (args.max_selections or 1 << 62)
  slots = sum(t.num_selections for t in traces)
  pool = args.pool if args.pool is not None else slots <= (1 << 26)
  t0 = time.perf_counter()
  stats = locality_stats(traces, max_selections=budget, seed=args.seed, shared_pool=pool)
  stats["seconds"] = time.perf_counter() - t0
  if not pool:
    stats["shared_pool_note"] = (f"not measured ({slots:,} selection slots); --pool replays "
                                 f"the shared pool")
  con = console()
  for table in locality_tables(stats, title=str(args.trace)):
    con.print(table)
  sampled = stats["trace"]["sampled_rows"]
  if sampled != "all":
    con.print(f"per-request statistics on rows {sampled} (of {stats['trace']['rows']}); "
              f"--max-selections 0 measures every row", highlight=False)
  if not pool:
    con.print(f"shared pool: {stats['shared_pool_note']}", highlight=False)
  if args.json:
    Path(args.json).write_text(dumps(stats, indent=1) + "\n")
    con.print(f"statistics: {args.json}")
  if args.plots:
    for path in plot_locality(stats, args.plots, title=Path(args.trace).name):
      con.print(f"plot: {path}")
  return EXIT_OK


def _progress(total: int | None, what: str):
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

  bar = Progress(TextColumn(f"[bold]{what}"), BarColumn(), MofNCompleteColumn(),
                 TimeElapsedColumn(), console=console(), transient=True)
  return bar, bar.add_task(what, total=total)


def _generate(args: argparse.Namespace) -> int:
  from ula_jax.memory.traces.generate import Locality, generate

  geo = _model_geometry(args.model, groups=args.groups, top_k=args.topk)
  steps = _range(args.steps, "--steps")
  context = _range(args.context, "--context")
  batch = args.batch or min(args.requests, 64)
  t0 = time.perf_counter()
  bar, task = _progress(None, "generating (decode steps)")
  with bar:
    out = generate(args.out, geo, requests=args.requests, steps=steps, context=context,
                   locality=Locality(args.overlap, args.group_share, args.recency),
                   max_batch=batch, page_size=args.page_size,
                   prefill_chunk=args.prefill_chunk, seed=args.seed,
                   on_step=lambda t: bar.update(task, completed=t))
  _describe(out, time.perf_counter() - t0)
  return EXIT_OK


def _import(args: argparse.Namespace) -> int:
  from ula_jax.memory.traces.sglang import import_sglang

  geo = _model_geometry(args.model)
  layers = None
  if args.layers:
    try:
      layers = [int(x) for x in args.layers.split(",")]
    except ValueError:
      raise argparse.ArgumentTypeError(f"--layers {args.layers!r}: expected comma-separated "
                                       f"indexer layer indices") from None
  t0 = time.perf_counter()
  out = import_sglang(args.src, args.out, geo, max_batch=args.batch, page_size=args.page_size,
                      prefill_chunk=args.prefill_chunk, layers=layers)
  _describe(out, time.perf_counter() - t0)
  return EXIT_OK


def _describe(out: Path, seconds: float) -> None:
  from ula_jax.memory.traces.format import SelectionTrace

  t = SelectionTrace.load(out)
  console().print(
      f"trace: {out} ({t.num_steps} decode steps, {t.max_batch} rows, {t.num_groups} layer "
      f"groups, top-k {t.top_k}, {t.num_logical:,} addresses, page {t.page_size}; "
      f"{seconds:.1f} s)\nreplay it: ula-jax run CONFIG workload.kind=trace "
      f"workload.trace={out} engine.max_batch={t.max_batch} engine.page_size={t.page_size}",
      highlight=False)
