"""``ula-jax``: run, sweep, inspect and compare experiments.

Each verb is a ``Verb`` in ``VERBS``: a function adding its arguments to an argparse
sub-parser and a handler returning the exit status. A new verb is one more entry;
``main`` builds the parser from the table.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import re
import sys
from pathlib import Path
from typing import Sequence

from ula_jax.config import (ConfigError, config_to_yaml, load_config, parse_value,
                            split_override)
from ula_jax.cli.common import (EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, Verb, add_config_arguments,
                                add_run_arguments, console)
from ula_jax.report.output import RunDirError
from ula_jax.workloads import WorkloadError

# ----------------------------------------------------------------------------------
# run
# ----------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
  from ula_jax.run import run_experiment

  cfg = load_config(args.config, args.overrides)
  run_experiment(cfg, out_dir=args.out, progress=not args.no_progress, console=console())
  return EXIT_OK


# ----------------------------------------------------------------------------------
# sweep
# ----------------------------------------------------------------------------------


def split_values(text: str) -> list[str]:
  """Splits a sweep value list at commas outside brackets and quotes:
  ``'1,2'`` -> ``['1', '2']``; ``'[1,2],[3,4]'`` -> ``['[1,2]', '[3,4]']``."""
  parts, depth, quote, cur = [], 0, None, ""
  for ch in text:
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "[{":
      depth += 1
    elif ch in "]}":
      depth -= 1
    elif ch == "," and depth == 0:
      parts.append(cur)
      cur = ""
      continue
    cur += ch
  parts.append(cur)
  return parts


def sweep_plan(items: Sequence[str]) -> tuple[dict[str, list[str]], list[str]]:
  """``key=v1,v2`` items -> swept keys with their values; ``key=v`` items stay fixed."""
  swept: dict[str, list[str]] = {}
  fixed: list[str] = []
  for item in items:
    key, value = split_override(item)
    values = split_values(value)
    if len(values) > 1:
      if key in swept:
        raise ConfigError([f"sweep: {key} is swept twice; give one list of values"])
      if any(not v.strip() for v in values):
        raise ConfigError([f"sweep: {key}={value!r} has an empty value in its list"])
      swept[key] = values
    else:
      fixed.append(item)
  if not swept:
    raise ConfigError(["sweep: no key has a list of values; give at least one "
                       "key=v1,v2 (e.g. memory.system=resident,ula)"])
  return swept, fixed


def combination_dirname(i: int, combo: dict[str, str]) -> str:
  """``003-system=ula-max_batch=4``: the index, then each swept key's last part."""
  parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in combo.items()]
  name = f"{i:03d}-" + "-".join(parts)
  return re.sub(r"[^A-Za-z0-9._=+-]+", "_", name)[:120]


def _sweep_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("config", help="experiment YAML")
  p.add_argument("items", nargs="*", metavar="key=v1,v2|key=value",
                 help="a comma-separated list of values is swept (cartesian product over "
                 "all swept keys); a single value is a fixed override")
  p.add_argument("--out", metavar="DIR", help="sweep directory, one run directory per "
                 "combination (default: {experiment.out_dir}/{name}-sweep-{timestamp})")
  p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _sweep(args: argparse.Namespace) -> int:
  from ula_jax.mesh import configure_platform
  from ula_jax.report.output import dumps, timestamp
  from ula_jax.report.plots import plot_sweep
  from ula_jax.report.stats import run_stats
  from ula_jax.report.tables import sweep_table
  from ula_jax.run import run_experiment

  swept, fixed = sweep_plan(args.items)
  keys = list(swept)
  combos = [dict(zip(keys, vals)) for vals in itertools.product(*swept.values())]
  # Every combination is validated before anything runs.
  cfgs = [load_config(args.config, [*fixed, *(f"{k}={v}" for k, v in c.items())])
          for c in combos]
  configure_platform(cfgs[0], num_devices=max(c.mesh.num_devices for c in cfgs))

  name = cfgs[0].experiment.name
  out = Path(args.out or Path(cfgs[0].experiment.out_dir) / f"{name}-sweep-{timestamp()}")
  out.mkdir(parents=True, exist_ok=True)
  con = console()
  rows = []
  for i, (combo, cfg) in enumerate(zip(combos, cfgs)):
    con.print(f"[{i + 1}/{len(combos)}] " + " ".join(f"{k}={v}" for k, v in combo.items()))
    result, run_dir = run_experiment(cfg, out_dir=out / combination_dirname(i, combo),
                                     progress=not args.no_progress, show=False,
                                     console=con)
    stats = run_stats(result)
    rows.append({**{k: parse_value(v) for k, v in combo.items()}, **stats,
                 "run_dir": str(run_dir)})

  (out / "sweep.json").write_text(dumps(
      {"config": str(args.config), "swept": swept, "fixed": fixed, "rows": rows}, indent=1) + "\n")
  columns = list(dict.fromkeys(k for row in rows for k in row))
  with (out / "sweep.csv").open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows({k: json.dumps(v) if isinstance(v, (list, dict)) else v
                      for k, v in row.items()} for row in rows)
  if len(keys) == 1 and all(isinstance(r[keys[0]], (int, float))
                            and not isinstance(r[keys[0]], bool) for r in rows):
    plot_sweep(rows, keys[0], out / "sweep.png")
  con.print(sweep_table(rows, keys, title=f"sweep of {name}"))
  con.print(f"sweep directory: {out}")
  return EXIT_OK


# ----------------------------------------------------------------------------------
# config, compare
# ----------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> int:
  cfg = load_config(args.config, args.overrides)
  sys.stdout.write(config_to_yaml(cfg))
  return EXIT_OK


def _compare_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("run_a", metavar="RUN_DIR_A")
  p.add_argument("run_b", metavar="RUN_DIR_B")


def _compare(args: argparse.Namespace) -> int:
  from ula_jax.report.compare import compare_runs
  from ula_jax.report.tables import compare_table

  cmp = compare_runs(args.run_a, args.run_b)
  con = console()
  con.print(compare_table(cmp.rows, title=f"A = {args.run_a}\nB = {args.run_b}"))
  if cmp.ok:
    con.print(f"all {len(cmp.rows)} requests match token by token")
    return EXIT_OK
  for row in cmp.mismatches:
    con.print(f"{row['id']}: {row['result']}", highlight=False)
  con.print(f"{len(cmp.mismatches)} of {len(cmp.rows)} requests differ")
  return EXIT_MISMATCH


def _bench_args(p: argparse.ArgumentParser) -> None:
  from ula_jax.bench import BENCHMARKS

  p.add_argument("benchmark", choices=BENCHMARKS, help="which benchmark")
  p.add_argument("args", nargs=argparse.REMAINDER,
                 help="the benchmark's own arguments (ula-jax bench NAME --help)")


def _bench(args: argparse.Namespace) -> int:
  import importlib

  return importlib.import_module(f"ula_jax.bench.{args.benchmark}").main(list(args.args))


# ----------------------------------------------------------------------------------
# launch
# ----------------------------------------------------------------------------------


def _launch_args(p: argparse.ArgumentParser) -> None:
  local = p.add_argument_group("one host (spawns the processes)")
  local.add_argument("--processes", type=int, metavar="N",
                     help="start N processes here (coordinator on 127.0.0.1, a free port)")
  joined = p.add_argument_group("one process of a multi-host run (run on every host)")
  joined.add_argument("--coordinator", metavar="HOST:PORT",
                      help="process 0's address, reachable from every host")
  joined.add_argument("--num-processes", type=int, metavar="N", help="processes in all")
  joined.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
  p.add_argument("--devices-per-process", type=int, metavar="K",
                 help="devices each process contributes (simulated CPU devices; with "
                 "--processes also the GPUs each process takes); default: the mesh's "
                 "devices divided by the processes")
  p.add_argument("--local-device-ids", metavar="IDS",
                 help="GPUs this process uses, e.g. 0,1,2,3 (--processes assigns them)")
  p.add_argument("command", nargs=argparse.REMAINDER, metavar="run CONFIG ...",
                 help="the verb to run in every process and its arguments")


def _launch(args: argparse.Namespace) -> int:
  from ula_jax.cli.launch import (LaunchError, ProcessSpec, launch_local, parse_device_ids,
                              run_process)

  joined = (args.coordinator, args.num_processes, args.process_id)
  try:
    if args.processes is not None:
      if any(v is not None for v in joined) or args.local_device_ids is not None:
        raise LaunchError("launch: --processes starts every process here; it cannot be "
                          "combined with --coordinator, --num-processes, --process-id or "
                          "--local-device-ids")
      return launch_local(args.processes, args.command, args.devices_per_process)
    if any(v is None for v in joined):
      raise LaunchError("launch: give --processes N (all processes on this host), or "
                        "--coordinator HOST:PORT, --num-processes N and --process-id I "
                        "(one process of a multi-host run)")
    if args.num_processes < 1:
      raise LaunchError(f"launch --num-processes={args.num_processes}: must be >= 1")
    if args.devices_per_process is not None and args.devices_per_process < 1:
      raise LaunchError(f"launch --devices-per-process={args.devices_per_process}: must "
                        f"be >= 1")
    ids = (None if args.local_device_ids is None
           else parse_device_ids(args.local_device_ids))
    spec = ProcessSpec(args.coordinator, args.num_processes, args.process_id,
                       args.devices_per_process, ids)
    return run_process(spec, args.command)
  except LaunchError as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USAGE


VERBS: dict[str, Verb] = {v.name: v for v in [
    Verb("run", "run one experiment", add_run_arguments, _run),
    Verb("sweep", "run the cartesian product of value lists, one table", _sweep_args, _sweep),
    Verb("config", "print the resolved config (validation only, no compute)", add_config_arguments,
         _config),
    Verb("compare", "compare two runs' generated tokens request by request (exit 1 on a "
         "mismatch)", _compare_args, _compare),
    Verb("bench", "benchmarks (fetch, attention, resolve, step_cost, tp_link, serving, "
         "kernel_report): a table and JSON", _bench_args,
         _bench),
    Verb("launch", "run an experiment as several jax.distributed processes (one host or "
         "many)", _launch_args, _launch),
]}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="ula-jax", description="KV-cache memory systems for sparse-attention decoding")
  sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
  for verb in VERBS.values():
    p = sub.add_parser(verb.name, help=verb.help, description=verb.help)
    verb.add_arguments(p)
    p.set_defaults(handler=verb.handler)
  return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The verb's arguments. Overrides may also follow options
  (``run CONFIG --no-progress a.b=v``), where argparse alone stops the positional list."""
  parser = build_parser()
  args, extra = parser.parse_known_args(argv)
  listed = next((n for n in ("overrides", "items") if isinstance(getattr(args, n, None), list)),
                None)
  if extra and listed and all("=" in e and not e.startswith("-") for e in extra):
    setattr(args, listed, [*getattr(args, listed), *extra])
  elif extra:
    parser.error(f"unrecognized arguments: {' '.join(extra)}")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``ula-jax``; returns the exit status (0 ok, 1 compare mismatch,
  2 bad config or arguments)."""
  args = parse_args(argv)
  try:
    return args.handler(args)
  except (ConfigError, WorkloadError, RunDirError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
  sys.exit(main())
