"""What every verb shares: the verb record, exit statuses, the console, and the
arguments of verbs that take an experiment config (``run`` also runs under ``launch``)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable

from rich.console import Console

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Verb:
  name: str
  help: str
  add_arguments: Callable[[argparse.ArgumentParser], None]
  handler: Callable[[argparse.Namespace], int]


def console() -> Console:
  console = Console()
  # Piped output has no terminal width; keep wide tables on one line per row.
  return console if console.is_terminal else Console(width=160)


def add_config_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("config", help="experiment YAML (e.g. experiments/quickstart/config.yaml)")
  p.add_argument("overrides", nargs="*", metavar="key=value",
                 help="dotted overrides, values parsed as YAML (memory.system=ula, "
                 "workload.prompt_len=[128,256]), or section=block (memory=ula_pb_lru)")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
  add_config_arguments(p)
  add_output_arguments(p, "run directory (default: "
                       "{experiment.out_dir}/{experiment.name}-{timestamp})")


def add_output_arguments(p: argparse.ArgumentParser, out_help: str) -> None:
  """--out DIR (``out_help`` says what it holds), --overwrite and --no-progress."""
  p.add_argument("--out", metavar="DIR",
                 help=f"{out_help}; an existing non-empty one is refused unless --overwrite")
  p.add_argument("--overwrite", action="store_true",
                 help="replace the contents of an existing --out directory (a previous "
                 "run or sweep)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
