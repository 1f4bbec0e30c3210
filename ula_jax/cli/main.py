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
import logging
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ula_jax.config import (ConfigError, config_to_yaml, load_config, parse_value,
                            split_override)
from ula_jax.cli.common import (EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, Verb, add_config_arguments,
                                add_output_arguments, console)
from ula_jax.report.output import (RunDirError, RunInterrupted, exit_status, handle_signals,
                                   raise_interrupted)
from ula_jax.cli.experiment import add_experiment_arguments, run_experiment_verb
from ula_jax.cli.trace import add_trace_arguments, run_trace
from ula_jax.train.command import add_train_arguments, run_train
from ula_jax.workloads import WorkloadError

if TYPE_CHECKING:
  from jax.sharding import Mesh

  from ula_jax.config import ExperimentConfig

# ----------------------------------------------------------------------------------
# run
# ----------------------------------------------------------------------------------


def _run_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("config", nargs="?",
                 help="experiment YAML (e.g. experiments/quickstart/config.yaml); none with "
                 "--resume")
  p.add_argument("overrides", nargs="*", metavar="key=value",
                 help="dotted overrides, values parsed as YAML (memory.system=ula, "
                 "workload.prompt_len=[128,256]), or section=block (memory=ula_pb_lru)")
  add_output_arguments(p, "run directory (default: "
                       "{experiment.out_dir}/{experiment.name}-{timestamp})")
  p.add_argument("--resume", metavar="DIR",
                 help="continue the interrupted run in DIR from its last checkpoint "
                 "(engine.checkpoint_every) with DIR's config.yaml, and write it into DIR; "
                 "overrides may change only fields that change no token (engine.max_steps, "
                 "engine.checkpoint_every, engine.progress, ...: the README lists them)")
  p.set_defaults(usage_error=p.error)


def _run(args: argparse.Namespace) -> int:
  from ula_jax.memory import check_config
  from ula_jax.run import resume_experiment, run_experiment

  if args.resume is not None:
    items = ([args.config] if args.config is not None else []) + list(args.overrides)
    problem = next((f"--resume {args.resume} takes the config from {args.resume}/"
                    f"config.yaml; give no CONFIG ({item!r}), only key=value overrides"
                    for item in items if "=" not in item), None)
    if problem is None and (args.out is not None or args.overwrite):
      problem = (f"--resume {args.resume} writes the run back into {args.resume}; "
                 f"--out and --overwrite do not apply")
    if problem is not None:
      print(f"error: {problem}", file=sys.stderr)
      return EXIT_USAGE

    def machine(cfg: ExperimentConfig) -> Mesh:
      check_config(cfg)
      return _machine_mesh(cfg)

    resume_experiment(args.resume, items, progress=not args.no_progress, machine=machine,
                      console=console())
    return EXIT_OK
  if args.config is None:
    args.usage_error("the following arguments are required: config (or --resume DIR)")
  cfg = load_config(args.config, args.overrides)
  check_config(cfg)
  mesh = _machine_mesh(cfg)
  run_experiment(cfg, out_dir=args.out, progress=not args.no_progress, console=console(),
                 mesh=mesh, overwrite=args.overwrite)
  return EXIT_OK


def _machine_mesh(cfg: ExperimentConfig) -> Mesh:
  """The mesh of ``cfg`` once this machine is known to hold its pools (ConfigError, exit
  2, before anything is allocated when it does not)."""
  from ula_jax.memory import check_fits_machine
  from ula_jax.mesh import build_mesh, configure_platform

  configure_platform(cfg)
  mesh = build_mesh(cfg)
  if cfg.workload.kind != "trace":  # a trace replay allocates no pools
    check_fits_machine(cfg, mesh, params_bytes=_param_bytes(cfg))
  return mesh


def _param_bytes(cfg: ExperimentConfig) -> int:
  """The model's parameter bytes (on every device), from shapes alone."""
  from ula_jax.models.transformer import param_bytes
  return param_bytes(cfg.model)


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
  for item in fixed:
    key = split_override(item)[0]
    if key in swept:
      # Overrides apply in order, so one of the two would silently win.
      raise ConfigError([f"sweep: {key} is both fixed ({item}) and swept ({key}="
                         f"{','.join(swept[key])}); give it once"])
  return swept, fixed


def combination_dirname(i: int, combo: dict[str, str]) -> str:
  """``003-system=ula-max_batch=4``: the index, then each swept key's last part."""
  parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in combo.items()]
  name = f"{i:03d}-" + "-".join(parts)
  return re.sub(r"[^A-Za-z0-9._=+-]+", "_", name)[:120]


EXIT_SWEEP_FAILED = 1
"""Exit status of a sweep in which some combination failed at run time (the others ran)."""


def _sweep_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("config", help="experiment YAML")
  p.add_argument("items", nargs="*", metavar="key=v1,v2|key=value",
                 help="a comma-separated list of values is swept (cartesian product over "
                 "all swept keys); a single value is a fixed override")
  add_output_arguments(p, "sweep directory, one run directory per combination (default: "
                       "{experiment.out_dir}/{name}-sweep-{timestamp})")


def _sweep(args: argparse.Namespace) -> int:
  from ula_jax.memory import check_config, check_fits_machine
  from ula_jax.mesh import build_mesh, configure_platform
  from ula_jax.report.output import claim_sweep_dir, dumps, timestamp
  from ula_jax.report.plots import plot_sweep
  from ula_jax.report.stats import run_stats
  from ula_jax.report.tables import sweep_table
  from ula_jax.run import run_experiment

  swept, fixed = sweep_plan(args.items)
  keys = list(swept)
  combos = [dict(zip(keys, vals)) for vals in itertools.product(*swept.values())]
  # Every combination is validated before anything runs, with every problem of every
  # combination in one error.
  cfgs, problems = [], []
  for c in combos:
    label = " ".join(f"{k}={v}" for k, v in c.items())
    try:
      cfg = load_config(args.config, [*fixed, *(f"{k}={v}" for k, v in c.items())])
      check_config(cfg)
      cfgs.append(cfg)
    except ConfigError as e:
      problems += [f"combination {label}: {p}" for p in e.problems]
  if problems:
    raise ConfigError(problems, source=str(args.config))
  configure_platform(cfgs[0], num_devices=max(c.mesh.num_devices for c in cfgs))
  for cfg in cfgs:
    if cfg.workload.kind != "trace":  # a trace replay allocates no pools
      check_fits_machine(cfg, build_mesh(cfg), params_bytes=_param_bytes(cfg))

  name = cfgs[0].experiment.name
  out = Path(args.out or Path(cfgs[0].experiment.out_dir) / f"{name}-sweep-{timestamp()}")
  # Refused when not empty (unless --overwrite, which empties it) or when another sweep
  # writes it; the lock is released when _sweep returns (DirLock releases when dropped).
  _, _out_lock = claim_sweep_dir(out, overwrite=args.overwrite)
  con = console()
  rows, failed = [], []
  for i, (combo, cfg) in enumerate(zip(combos, cfgs)):
    label = " ".join(f"{k}={v}" for k, v in combo.items())
    con.print(f"[{i + 1}/{len(combos)}] {label}")
    run_dir = out / combination_dirname(i, combo)
    values = {k: parse_value(v) for k, v in combo.items()}
    try:
      result, run_dir = run_experiment(cfg, out_dir=run_dir, progress=not args.no_progress,
                                       show=False, console=con)
    except Exception as e:  # one combination failing must not lose the others' results
      error = f"{type(e).__name__}: {e}"
      con.print(f"combination {label} failed: {error}", highlight=False, markup=False)
      failed.append(label)
      rows.append({**values, "status": "failed", "error": error, "run_dir": str(run_dir)})
      continue
    rows.append({**values, "status": "ok", **run_stats(result), "run_dir": str(run_dir)})

  (out / "sweep.json").write_text(dumps(
      {"config": str(args.config), "swept": swept, "fixed": fixed, "rows": rows}, indent=1) + "\n")
  columns = list(dict.fromkeys(k for row in rows for k in row))
  with (out / "sweep.csv").open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows({k: json.dumps(v) if isinstance(v, (list, dict)) else v
                      for k, v in row.items()} for row in rows)
  ok_rows = [r for r in rows if r["status"] == "ok"]
  if len(keys) == 1 and ok_rows and all(isinstance(r[keys[0]], (int, float))
                                        and not isinstance(r[keys[0]], bool) for r in ok_rows):
    plot_sweep(ok_rows, keys[0], out / "sweep.png")
  con.print(sweep_table(rows, keys, title=f"sweep of {name}"))
  con.print(f"sweep directory: {out}")
  if failed:
    print(f"error: {len(failed)} of {len(combos)} combinations failed (status 'failed' and "
          f"the error in sweep.json / sweep.csv): {'; '.join(failed)}", file=sys.stderr)
    return EXIT_SWEEP_FAILED
  return EXIT_OK


# ----------------------------------------------------------------------------------
# config, compare
# ----------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> int:
  from ula_jax.memory import check_config

  cfg = load_config(args.config, args.overrides)
  check_config(cfg)  # the memory system's own size checks (no arrays, no devices)
  sys.stdout.write(config_to_yaml(cfg))
  return EXIT_OK


def _compare_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("run_a", metavar="RUN_DIR_A")
  p.add_argument("run_b", metavar="RUN_DIR_B")


def _compare(args: argparse.Namespace) -> int:
  from ula_jax.report.compare import compare_runs
  from ula_jax.report.tables import compare_table

  # Refuses (exit 2) runs of different workloads or models, or with no token to compare.
  cmp = compare_runs(args.run_a, args.run_b)
  con = console()
  con.print(compare_table(cmp.rows, title=f"A = {args.run_a}\nB = {args.run_b}"))
  for note in cmp.notes:
    con.print(f"note: {note}", highlight=False, markup=False)
  if cmp.digest_differences is not None:
    # engine.record_digests in both runs: where the bits first differed, per request
    # (also for requests whose tokens still agree).
    for rid, where in cmp.digest_differences.items():
      con.print(f"{rid}: first different bits at {where}", highlight=False, markup=False)
    if not cmp.digest_differences:
      con.print("digests: every shared decode step computed the same bits")
  if cmp.ok:
    con.print(f"all {len(cmp.rows)} requests match token by token ({cmp.tokens_compared} "
              f"tokens compared)")
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

  module = importlib.import_module(f"ula_jax.bench.{args.benchmark}")
  try:
    return module.main(list(args.args))
  except ValueError as e:
    # A benchmark's own flags (--pools abc) are parsed by its main: a message and exit 2
    # rather than a traceback.
    print(f"error: ula-jax bench {args.benchmark}: {e}", file=sys.stderr)
    return EXIT_USAGE


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
    Verb("run", "run one experiment, or resume an interrupted one (--resume DIR)", _run_args,
         _run),
    Verb("sweep", "run the cartesian product of value lists, one table", _sweep_args, _sweep),
    Verb("config", "print the resolved config (validation only, no compute)", add_config_arguments,
         _config),
    Verb("compare", "compare two runs' generated tokens request by request (exit 1 on a "
         "mismatch; 2 when the runs' workloads or models differ)", _compare_args, _compare),
    Verb("bench", "benchmarks (fetch, attention, resolve, step_cost, tp_link, serving, "
         "kernel_report, compile, prefill, kernels_table): a table and JSON", _bench_args,
         _bench),
    Verb("train", "train the MLA + DSA model on text (dense warm-up with the indexer's KL, "
         "then top-k attention); orbax checkpoints, --resume", add_train_arguments, run_train),
    Verb("trace", "selection traces: locality statistics (stats), a synthetic trace "
         "(generate), SGLang indexer_topk arrays (import); replay one with ula-jax run and "
         "workload.kind=trace", add_trace_arguments, run_trace),
    Verb("launch", "run an experiment as several jax.distributed processes (one host or "
         "many)", _launch_args, _launch),
    Verb("experiment", "the papers' questions, one command each: a figure, a table and "
         "JSON (ula-jax experiment list)", add_experiment_arguments, run_experiment_verb),
]}


LOG_LEVELS = ("warning", "info", "debug")


def configure_logging(level: str) -> None:
  """``--log-level``: at 'warning' the package's warnings reach stderr as bare lines
  (logging's last-resort handler); 'info' and 'debug' add a time-stamped handler to the
  ``ula_jax`` logger."""
  if level == "warning":
    return
  log = logging.getLogger("ula_jax")
  if not any(h.get_name() == "ula_jax.cli" for h in log.handlers):  # once per process
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name("ula_jax.cli")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
  log.setLevel(logging.INFO if level == "info" else logging.DEBUG)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="ula-jax", description="KV-cache memory systems for sparse-attention decoding")
  parser.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                      help="messages shown on stderr: 'info' adds the benchmarks' and "
                      "experiments' progress lines with the time (e.g. each serving point's "
                      "engine steps), 'debug' everything (default: warning)")
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
  """Entry point of ``ula-jax``; returns the exit status (0 ok, 1 compare mismatch or a
  failed sweep combination, 2 bad config, arguments, environment or run directory,
  130 / 143 interrupted by SIGINT / SIGTERM)."""
  args = parse_args(argv)
  configure_logging(args.log_level)
  try:
    # SIGTERM ends a verb as Ctrl-C does (a run installs its own, gentler handler).
    with handle_signals(raise_interrupted, (signal.SIGTERM,)):
      return args.handler(args)
  except (ConfigError, WorkloadError, RunDirError) as e:
    print(f"error: {e}", file=sys.stderr)
    return EXIT_USAGE
  except KeyboardInterrupt as e:  # SIGINT, or SIGTERM (RunInterrupted)
    run_dir = getattr(e, "run_dir", None)
    what = e.signal_name if isinstance(e, RunInterrupted) else "SIGINT"
    print(f"interrupted ({what}); " + (f"run directory written: {run_dir}" if run_dir
                                       else "no run directory written"), file=sys.stderr)
    return exit_status(e)


if __name__ == "__main__":
  sys.exit(main())
