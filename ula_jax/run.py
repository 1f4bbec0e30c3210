"""Runs one experiment end to end and writes its run directory; resumes one from its
checkpoint (``ula-jax run --resume DIR``)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np
import yaml
from jax.sharding import Mesh
from rich.console import Console

from ula_jax.config import ConfigError, ExperimentConfig, config_to_yaml, load_config
from ula_jax.engine.types import Request, RunResult
from ula_jax.mesh import build_mesh, configure_platform
from ula_jax.report import (CONFIG_FILE, METRICS_FILE, MetricsWriter, RunProgress,
                            summary_table, write_outputs)
from ula_jax.report.output import (DIGESTS_FILE, SUMMARY_FILE, RunDirError, RunDirTarget,
                                   RunInterrupted, StopRequest, claim_dir, handle_signals,
                                   run_status)
from ula_jax.workloads import build_requests


def run_experiment(cfg: ExperimentConfig, out_dir: str | Path | None = None,
                   progress: bool = True, *, mesh: Mesh | None = None, show: bool = True,
                   console: Console | None = None, overwrite: bool = False,
                   ready: Callable[[], None] | None = None) -> tuple[RunResult, Path]:
  """Serves the workload of ``cfg`` and records the run.

  out_dir: the run directory; None = ``{experiment.out_dir}/{name}-{timestamp}``. An
    existing non-empty one is refused (RunDirError) unless ``overwrite``, which
    replaces its contents when the run ends; so is one another run is writing.
  progress: a progress bar (also needs ``engine.progress``)
  mesh: the device mesh; None = ``build_mesh(cfg)`` (after ``configure_platform``)
  show: print the summary table at the end
  overwrite: replace the contents of an existing ``out_dir``
  ready: called once everything before the first step has passed (the run directory,
    the engine's pools and parameters, its step-memory check), before the first step;
    what it raises fails the run there (a multi-process worker learns there whether
    every other process got as far: ``cli.launch``)

  The run directory gets ``config.yaml`` (resolved), ``metrics.jsonl`` (one line per
  engine step, written as the run goes), ``summary.json``, ``requests.jsonl`` and
  ``run.png`` (when ``experiment.plots``). They are written into a hidden sibling
  folder renamed into place at the end (``RunDirTarget``), so the directory appears
  complete or not at all. Returns the engine's result and the directory.

  SIGINT or SIGTERM (main thread) stops the engine after its current step (a second
  one at once); the run directory is still written, ``summary.json`` with
  ``"status": "interrupted"``, and then RunInterrupted is raised, its ``run_dir`` set.
  A failure leaves no directory behind (nor does a second signal before the engine's
  loop starts).

  With ``engine.checkpoint_every = N > 0`` the run directory also holds the run's
  latest checkpoint (``engine.checkpoint``), taken every N steps and at the signal, from
  which ``resume_experiment`` continues; a run that ends without an interrupt removes
  it. A run killed outright leaves it in the hidden folder, where ``--resume`` finds it.
  """
  if cfg.workload.kind == "trace":
    return _replay_trace(cfg, out_dir, progress=progress, show=show, console=console,
                         overwrite=overwrite)
  # Everything that can fail on the config or --out fails before any compute, and
  # before the run directory exists.
  requests = build_requests(cfg)
  target = RunDirTarget.claim(out_dir, parent=cfg.experiment.out_dir,
                              name=cfg.experiment.name, overwrite=overwrite)
  return _serve(cfg, requests, target, progress=progress, mesh=mesh, show=show,
                console=console, on_failure=target.abandon, ready=ready)


def _serve(cfg: ExperimentConfig, requests: list[Request], target: RunDirTarget, *,
           progress: bool, mesh: Mesh | None, show: bool, console: Console | None,
           on_failure: Callable[[], None], resume_from: Path | None = None,
           ready: Callable[[], None] | None = None) -> tuple[RunResult, Path]:
  """Runs the engine into ``target`` (from the checkpoint ``resume_from``, if given)
  and commits it; ``on_failure`` when that fails."""
  from ula_jax.engine import Engine  # the engine pulls in the model and kernels
  from ula_jax.engine import checkpoint

  every = cfg.engine.checkpoint_every
  checkpoints = target.partial / checkpoint.CHECKPOINT_DIR
  stop = StopRequest()
  try:
    with handle_signals(stop):
      if mesh is None:
        configure_platform(cfg)
        mesh = build_mesh(cfg)
      if every and jax.process_count() > 1:
        raise ConfigError([f"engine.checkpoint_every={every}: checkpoints are written by "
                           f"single-process runs only (this run has {jax.process_count()} "
                           f"processes); set engine.checkpoint_every=0"])
      try:
        engine = Engine(cfg, mesh)
      except ConfigError:
        raise
      except ValueError as e:  # sizes a memory system or the model can never serve
        raise ConfigError([str(e)]) from e
      run_state = None
      if resume_from is not None:
        try:
          run_state = checkpoint.restore(engine, resume_from, requests)
        except checkpoint.CheckpointError as e:
          raise RunDirError(f"--resume: {e}") from None

      (target.partial / CONFIG_FILE).write_text(config_to_yaml(cfg))
      engine.check_step_memory()  # (once: the engine's run does not repeat it)
      if ready is not None:
        ready()
      console = console or Console()
      with MetricsWriter(target.partial / METRICS_FILE) as metrics, \
          RunProgress(len(requests), enabled=progress and cfg.engine.progress,
                      description=cfg.experiment.name) as bar:
        for m in run_state.steps if run_state is not None else ():
          metrics.write(m)

        def on_step(m) -> None:
          metrics.write(m)
          bar.update(m)
          if every and len(engine.run_state.steps) % every == 0:
            _save_checkpoint(engine, checkpoints)
          stop.check()  # a signal noted during the step ends the run here

        result = engine.run(requests, on_step=on_step, resume=run_state)

      # Signals while the results are written are noted, not raised: a run directory is
      # never lost half written. The first is raised once it is in place.
      stop.finishing = True
      if run_status(result) != "interrupted":  # the run ended: nothing to resume
        shutil.rmtree(checkpoints, ignore_errors=True)
      elif every and engine.run_state.at_boundary:
        # (stopped inside a step by a second signal: the last checkpoint stays the latest)
        _save_checkpoint(engine, checkpoints)
      if result.traces is not None:
        _record_traces(cfg, result, target.partial)
      if result.digests is not None:
        np.savez_compressed(target.partial / DIGESTS_FILE, **result.digests)
      stats = write_outputs(target.partial, result, name=cfg.experiment.name,
                            plots=cfg.experiment.plots,
                            prompts={r.id: r.prompt for r in requests})
      run_dir = target.commit()
  except BaseException:
    on_failure()
    raise

  status = run_status(result)
  if show:
    console.print(summary_table(stats, title=f"{cfg.experiment.name} ({cfg.memory.system})"))
    if status != "finished":
      console.print(f"run {status} by {result.summary['interrupted_by']}: "
                    f"{stats['finished']} of {stats['requests']} requests finished")
      if checkpoint.latest(Path(run_dir) / checkpoint.CHECKPOINT_DIR) is not None:
        console.print(f"continue it with: ula-jax run --resume {run_dir}", highlight=False)
    console.print(f"run directory: {run_dir}")
  if stop.signum is not None:
    raise RunInterrupted(stop.signum, run_dir=run_dir)
  return result, run_dir


def _replay_trace(cfg: ExperimentConfig, out_dir: str | Path | None, *, progress: bool,
                  show: bool, console: Console | None,
                  overwrite: bool) -> tuple[RunResult, Path]:
  """``workload.kind: trace``: replays the trace through the memory system without the
  model (``workloads.trace``) and writes a run directory as a live run does
  (``config.yaml``, ``metrics.jsonl``, ``summary.json``, ``requests.jsonl``, ``run.png``)."""
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

  from ula_jax.workloads.trace import TraceWorkloadError, replay_workload

  target = RunDirTarget.claim(out_dir, parent=cfg.experiment.out_dir,
                              name=cfg.experiment.name, overwrite=overwrite)
  try:
    configure_platform(cfg)  # ula TP replays over mesh.tp (simulated) devices
    (target.partial / CONFIG_FILE).write_text(config_to_yaml(cfg))
    bar = Progress(TextColumn(f"[bold]{cfg.experiment.name} (trace replay)"), BarColumn(),
                   MofNCompleteColumn(), TimeElapsedColumn(), console=Console(stderr=True),
                   disable=not (progress and cfg.engine.progress))
    with bar:
      task = bar.add_task("replay", total=None)
      try:
        result = replay_workload(
            cfg, on_progress=lambda n, total: bar.update(task, completed=n, total=total))
      except TraceWorkloadError as e:
        raise ConfigError([str(e)]) from None
    with MetricsWriter(target.partial / METRICS_FILE) as metrics:
      for m in result.steps:
        metrics.write(m)
    stats = write_outputs(target.partial, result, name=cfg.experiment.name,
                          plots=cfg.experiment.plots)
    run_dir = target.commit()
  except BaseException:
    target.abandon()
    raise
  if show:
    console = console or Console()
    console.print(summary_table(
        stats, title=f"{cfg.experiment.name} ({cfg.memory.system}, trace replay)"))
    console.print(f"run directory: {run_dir}")
  return result, run_dir


def _save_checkpoint(engine, root: Path) -> None:
  """A checkpoint of the run; one that cannot be written is reported and the run goes on
  (its directory matters more)."""
  from ula_jax.engine import checkpoint

  try:
    checkpoint.save(engine, root)
  except Exception as e:  # a full disk, a file system error
    print(f"warning: no checkpoint at engine step {engine.run_state.step}: "
          f"{type(e).__name__}: {e}", file=sys.stderr)


# ----------------------------------------------------------------------------------
# --resume
# ----------------------------------------------------------------------------------

# The hidden folder a run writes before its directory is renamed into place
# (``RunDirTarget``): ``.NAME.partial-PID`` (``--out``) or ``.NAME.partial-PID-XXXX``.
_PARTIAL = re.compile(r"\.(?P<final>.+)\.partial-(?P<pid>\d+)(?:-[^/]*)?")


@dataclasses.dataclass(frozen=True)
class ResumeSource:
  """Where a resumed run comes from and goes to."""

  final: Path  # the run directory it is written to
  folder: Path  # the folder holding the checkpoint: ``final``, or a killed run's partial one
  checkpoint: Path  # the latest checkpoint in ``folder``


def find_resume_source(run_dir: str | Path) -> ResumeSource:
  """The checkpoint ``ula-jax run --resume run_dir`` continues from: the latest of the
  run directory's and of the hidden partial folders beside it that no live process
  writes (a run killed before its directory was written). ``run_dir`` may also name
  such a folder. RunDirError (exit 2) saying why when there is none."""
  from ula_jax.engine import checkpoint

  where = f"--resume {run_dir}"
  given = Path(os.path.abspath(run_dir))
  m = _PARTIAL.fullmatch(given.name)
  final = given.parent / m["final"] if m else given
  if given.exists() and not given.is_dir():
    raise RunDirError(f"{where}: is not a directory; give a run directory")
  partials = (sorted(final.parent.glob(f".{final.name}.partial-*"))
              if final.parent.is_dir() else [])
  live = [p for p in partials if _writer_alive(p)]
  found = []
  for folder in ([final] if final.is_dir() else []) + [p for p in partials if p not in live]:
    latest = checkpoint.latest(folder / checkpoint.CHECKPOINT_DIR)
    if latest is not None and (folder / CONFIG_FILE).is_file():
      found.append((checkpoint.step_of(latest), folder == final, folder, latest))
  if found:
    _, _, folder, latest = max(found)
    return ResumeSource(final, folder, latest)

  if not final.exists() and not partials:
    raise RunDirError(f"{where}: no such run directory")
  if live:
    raise RunDirError(f"{where}: a run (pid {_PARTIAL.fullmatch(live[0].name)['pid']}) is "
                      f"still writing it ({live[0]}); wait for it to end or stop it first")
  summary = _read_json(final / SUMMARY_FILE)
  if isinstance(summary, dict) and summary.get("status") == "finished":
    raise RunDirError(f"{where}: the run finished ({SUMMARY_FILE}: status 'finished'); "
                      f"there is nothing to resume")
  config = next((f / CONFIG_FILE for f in [final, *partials] if (f / CONFIG_FILE).is_file()),
                None)
  if config is None:
    raise RunDirError(f"{where}: not a run directory (no {CONFIG_FILE})")
  every = (_read_yaml(config).get("engine") or {}).get("checkpoint_every", 0)
  why = (f"the run had engine.checkpoint_every={every}; with engine.checkpoint_every=N > 0 "
         f"a run writes one every N steps and at SIGINT/SIGTERM" if not every
         else "the run stopped before it wrote one")
  raise RunDirError(f"{where}: no checkpoint to resume from "
                    f"({final / checkpoint.CHECKPOINT_DIR} has "
                    f"no step-* folder): {why}")


def _check_resumable(cfg: ExperimentConfig, src: ResumeSource, run_dir: str | Path) -> None:
  """ConfigError naming every field ``cfg`` changes from the checkpoint's config but
  ``checkpoint.RESUMABLE_FIELDS``."""
  from ula_jax.engine import checkpoint

  try:
    saved = checkpoint.read_host(src.checkpoint)
  except checkpoint.CheckpointError as e:
    raise RunDirError(f"--resume {run_dir}: {e}") from None
  problems = checkpoint.config_changes(saved["config"], cfg)
  if problems:
    raise ConfigError(problems + [
        f"a resumed run keeps the checkpointed run's config; it may change only "
        f"{', '.join(checkpoint.RESUMABLE_FIELDS)}"], source=f"--resume {run_dir}")


def resume_experiment(run_dir: str | Path, overrides: Sequence[str] = (),
                      progress: bool = True, *,
                      machine: Callable[[ExperimentConfig], Mesh] | None = None,
                      show: bool = True,
                      console: Console | None = None) -> tuple[RunResult, Path]:
  """Continues the run in ``run_dir`` from its latest checkpoint (``find_resume_source``)
  and writes it there, as ``run_experiment`` writes a run: its tokens are those the
  run would have decoded uninterrupted, its metrics go on from the checkpoint's.

  overrides: ``a.b=value`` items applied to the run's ``config.yaml``; they may change
    only ``checkpoint.RESUMABLE_FIELDS``
  machine: the run's config -> its mesh, once the config is known (e.g. after checking
    the machine holds its pools); None = ``build_mesh`` after ``configure_platform``

  Refused (RunDirError or ConfigError, exit 2): no such directory, a finished run, no
  checkpoint, another run writing it, a config or workload unlike the checkpoint's.
  The directory's contents are replaced when the run ends; until then it stays as it
  was. A resumed run that fails keeps the checkpoints it took (for the next
  ``--resume``). Interrupted again, it can be resumed again.
  """
  from ula_jax.engine import checkpoint

  src = find_resume_source(run_dir)
  lock = claim_dir(src.final, "--resume")
  partial = None
  try:
    src = find_resume_source(run_dir)  # again, now that no other run can write it
    cfg = load_config(src.folder / CONFIG_FILE, overrides)
    _check_resumable(cfg, src, run_dir)
    requests = build_requests(cfg)
    mesh = machine(cfg) if machine is not None else None
    partial = Path(tempfile.mkdtemp(prefix=f".{src.final.name}.partial-{os.getpid()}-",
                                    dir=src.final.parent))
    # The run directory keeps a checkpoint whatever happens next: the one resumed from
    # (hard links: no bytes copied), until the run takes its own.
    _link_tree(src.checkpoint, partial / checkpoint.CHECKPOINT_DIR / src.checkpoint.name)
  except BaseException:
    if partial is not None:
      shutil.rmtree(partial, ignore_errors=True)
    lock.release()
    raise
  target = RunDirTarget(src.final, partial, None, overwrite=True)
  target.shown = src.final if src.final != Path(os.path.abspath(run_dir)) else Path(run_dir)
  failed = []

  def on_failure() -> None:
    failed.append(True)
    latest = checkpoint.latest(partial / checkpoint.CHECKPOINT_DIR)
    if latest is not None and checkpoint.step_of(latest) > checkpoint.step_of(src.checkpoint):
      print(f"the resumed run's latest checkpoint (step {checkpoint.step_of(latest)}) is "
            f"kept in {partial}; ula-jax run --resume {target.shown} continues from it",
            file=sys.stderr)
    else:
      shutil.rmtree(partial, ignore_errors=True)

  try:
    return _serve(cfg, requests, target, progress=progress, mesh=mesh, show=show,
                  console=console, on_failure=on_failure, resume_from=src.checkpoint)
  finally:
    if not failed:  # written into place: the folders it came from are done
      for stale in src.final.parent.glob(f".{src.final.name}.partial-*"):
        if not _writer_alive(stale):
          shutil.rmtree(stale, ignore_errors=True)
    lock.release()


def _writer_alive(partial: Path) -> bool:
  """Whether the process named in a partial folder's name still runs (not this one)."""
  m = _PARTIAL.fullmatch(partial.name)
  if m is None or int(m["pid"]) == os.getpid():
    return False
  try:
    os.kill(int(m["pid"]), 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def _link_tree(src: Path, dst: Path) -> None:
  """``src`` copied to ``dst`` as hard links (a copy where the file system has none)."""
  def link(a: str, b: str) -> None:
    try:
      os.link(a, b)
    except OSError:
      shutil.copy2(a, b)

  shutil.copytree(src, dst, copy_function=link)


def _read_json(path: Path):
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def _read_yaml(path: Path) -> dict:
  try:
    doc = yaml.safe_load(path.read_text())
  except (OSError, yaml.YAMLError):
    return {}
  return doc if isinstance(doc, dict) else {}


def _record_traces(cfg: ExperimentConfig, result: RunResult, run_dir: Path) -> None:
  """Writes each rank's selection trace; for ``ula`` (one tp rank) replays the traces
  under both policies with the run's pool sizes and puts the hit rates side by side in
  the summary (``policy_comparison``)."""
  from ula_jax.memory.ula.trace import compare_policies_per_rank

  for d, trace in enumerate(result.traces):
    trace.save(run_dir / f"trace_rank{d}.npz")
  _locality_summary(cfg, result, run_dir)
  if cfg.memory.system != "ula" or cfg.mesh.tp != 1:
    return
  per_rank = compare_policies_per_rank([t for t in result.traces if t.num_steps], cfg.memory)
  if not per_rank:
    return
  out: dict = {}
  for policy in ("pb_lru", "lru"):
    hits = sum(r[policy]["hits"] for r in per_rank)
    misses = sum(r[policy]["misses"] for r in per_rank)
    out[policy] = {"hits": hits, "misses": misses,
                   "evictions": sum(r[policy]["evictions"] for r in per_rank),
                   "resolve_seconds": sum(r[policy]["resolve_seconds"] for r in per_rank),
                   "hit_rate": hits / (hits + misses) if hits + misses else 1.0}
  out["hit_rate_gap_pp"] = 100.0 * (out["pb_lru"]["hit_rate"] - out["lru"]["hit_rate"])
  result.summary["policy_comparison"] = out


# A recorded run's locality statistics stay cheap: the shared-pool replays (six, NumPy)
# only up to this many selection slots, the per-request figures on a sample of rows past
# SUMMARY_MAX_SELECTIONS per rank.
SUMMARY_POOL_MAX_SELECTIONS = 1 << 24
SUMMARY_MAX_SELECTIONS = 1 << 26


def _locality_summary(cfg: ExperimentConfig, result: RunResult, run_dir: Path) -> None:
  """The recorded traces' locality statistics (``memory.traces.stats``) in the summary
  (``locality``) and, with ``experiment.plots``, as ``locality_*.png``."""
  from ula_jax.memory.traces.stats import locality_stats

  traces = [t for t in result.traces if t.num_steps]
  if not traces:
    return
  small = sum(t.num_selections for t in traces) <= SUMMARY_POOL_MAX_SELECTIONS
  result.summary["locality"] = locality_stats(traces, shared_pool=small,
                                              max_selections=SUMMARY_MAX_SELECTIONS)
  if cfg.experiment.plots:
    from ula_jax.report.locality import plot_locality

    plot_locality(result.summary["locality"], run_dir, title=cfg.experiment.name)
