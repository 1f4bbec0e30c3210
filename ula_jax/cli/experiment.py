"""``ula-jax experiment``: the papers' questions, one command each.

    ula-jax experiment list
    ula-jax experiment NAME [--scale cpu|gpu] [a.b=value ...] [--out DIR] [--no-progress]

Exit status: 0, 1 when a check the experiment claims does not hold (the run directory
is still written), 2 for an unknown name, a bad parameter or output directory.
"""

from __future__ import annotations

import argparse
import sys

from ula_jax.cli.common import EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, console


def add_experiment_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("name", metavar="NAME",
                 help="an experiment (capacity, throughput, latency, policies, "
                 "buffer_sizing, layouts, far_tier), or 'list'")
  p.add_argument("overrides", nargs="*", metavar="a.b=value",
                 help="parameter overrides of the scale's section of "
                 "experiments/NAME/experiment.yaml (values parsed as YAML)")
  p.add_argument("--scale", choices=("cpu", "gpu"), default="cpu",
                 help="cpu: simulated CPU devices, small sizes (default); gpu: one H200")
  p.add_argument("--out", metavar="DIR",
                 help="experiment directory (default: runs/experiments/NAME-SCALE-"
                 "{timestamp}); an existing non-empty one is refused")
  p.add_argument("--no-progress", action="store_true", help="no progress lines")


def run_experiment_verb(args: argparse.Namespace) -> int:
  from ula_jax import experiments

  if args.name == "list":
    if args.overrides:
      print(f"error: ula-jax experiment list takes no overrides ({' '.join(args.overrides)})",
            file=sys.stderr)
      return EXIT_USAGE
    return _list()
  try:
    experiments.get(args.name)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USAGE
  outcome, run_dir = experiments.run(args.name, args.scale, args.overrides, out=args.out,
                                     progress=not args.no_progress, console=console())
  if not outcome.ok:
    bad = [c.name for c in outcome.checks if not c.holds]
    print(f"error: {len(bad)} check(s) of {args.name} do not hold: {'; '.join(bad)} "
          f"({run_dir}/results.json)", file=sys.stderr)
    return EXIT_MISMATCH
  return EXIT_OK


def _list() -> int:
  from rich.table import Table

  from ula_jax import experiments

  table = Table(title="ula-jax experiment NAME [--scale cpu|gpu]")
  for c in ("name", "question", "anchor"):
    table.add_column(c)
  for exp in experiments.all_experiments():
    table.add_row(exp.name, exp.question, exp.anchor)
  console().print(table)
  return EXIT_OK
