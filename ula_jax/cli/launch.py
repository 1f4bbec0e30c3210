"""Multi-process runs on JAX's own runtime (``jax.distributed``).

One experiment, several processes, one global ``('dp', 'tp')`` mesh over all their
devices. Every process runs the normal ``run`` path (the same config, the same
deterministic schedule); only process 0 writes the run directory and prints the table.

Two ways to start it, one verb:

* on one host, ``ula-jax launch --processes N [--devices-per-process K] run CONFIG ...``
  spawns the N processes itself (coordinator ``127.0.0.1`` at a free port; process i
  gets devices ``[i*K, (i+1)*K)`` of a GPU host, or K simulated devices on CPU), waits
  for them, and stops the others when one fails;
* across hosts, each host runs ``ula-jax launch --coordinator HOST:PORT
  --num-processes N --process-id I run CONFIG ...`` (process 0's host serves as the
  coordinator).

On CPU the processes talk through JAX's gloo collectives (TCP, loopback on one host).

Before the first step every worker reports to the coordinator's key-value store that its
setup passed (run directory, pools, parameters, step-memory check), or why it failed,
and waits for every other worker's report (``report_ready``). A process that fails
there (a device with less free memory than the others, a run directory it cannot
write) so stops every process at once, each naming it, rather than leaving them waiting
in the first collective for the runtime's timeout: the one guard processes started on
several hosts with ``--coordinator`` have, as no launcher watches them.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

from ula_jax.cli.common import add_run_arguments, console

LAUNCHABLE = ("run",)  # verbs that run under launch
LOCALHOST = "127.0.0.1"
LOOPBACK = (LOCALHOST, "localhost", "[::1]", "::1")
# Lines of a failed worker's stderr shown by the local launcher.
STDERR_TAIL = 40


class LaunchError(ValueError):
  """Launch arguments that can never work (the message names the flag and value)."""


# The key-value store's keys where each process reports its setup ("ok", or its exit
# status and error), and how long a process waits for the others' reports.
READY_DIR = "ula_jax/launch/ready/"
READY_TIMEOUT_S = 3600.0


class PeerFailure(RuntimeError):
  """Another process of the run failed before its first step (``report_ready``)."""

  def __init__(self, code: int, message: str):
    super().__init__(message)
    self.code = code


def _ready_key(process_id: int) -> str:
  return f"{READY_DIR}{process_id}"


def report_ready(client: Any, process_id: int, num_processes: int, *,
                 timeout_s: float = READY_TIMEOUT_S, poll_s: float = 0.25) -> None:
  """Reports this process's setup as passed, then waits until every process has
  reported: returns when all passed; raises ``PeerFailure`` naming each process that
  reported a failure (as soon as one has), or that reported nothing in ``timeout_s``.
  client: ``jax.distributed``'s key-value client."""
  client.key_value_set(_ready_key(process_id), "ok")
  deadline = time.monotonic() + timeout_s
  while True:
    found = {int(k.rsplit("/", 1)[-1]): v for k, v in client.key_value_dir_get(READY_DIR)}
    failed = {p: v.split("\n", 1) for p, v in sorted(found.items()) if v != "ok"}
    if failed:
      raise PeerFailure(max(int(code) for code, _ in failed.values()), "; ".join(
          f"process {p} failed before the first step: {why}"
          for p, (_, why) in failed.items()))
    if len(found) == num_processes:
      return
    if time.monotonic() > deadline:
      missing = sorted(set(range(num_processes)) - set(found))
      raise PeerFailure(1, f"process(es) {missing} reported neither a finished setup nor a "
                           f"failure within {timeout_s:.0f} s")
    time.sleep(poll_s)


def report_failure(client: Any, process_id: int, code: int, message: str) -> None:
  """Reports this process's failure before its first step to the others waiting in
  ``report_ready`` (nothing where it had already reported, or the store is gone)."""
  try:
    client.key_value_set(_ready_key(process_id), f"{code}\n{message}")
  except Exception:  # noqa: BLE001 - the process is exiting with its own error anyway
    pass


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
  """One process of a multi-process run."""

  coordinator: str  # HOST:PORT of process 0's coordinator service
  num_processes: int
  process_id: int
  devices_per_process: int | None = None  # simulated CPU devices (None: derived)
  local_device_ids: tuple[int, ...] | None = None  # accelerators this process uses


# ----------------------------------------------------------------------------------
# Argument checks (pure, shared by the launcher and the workers)
# ----------------------------------------------------------------------------------


def parse_device_ids(text: str) -> tuple[int, ...]:
  """``'0,1,2'`` -> ``(0, 1, 2)`` (LaunchError naming --local-device-ids otherwise)."""
  try:
    ids = tuple(int(p) for p in text.split(","))
  except ValueError:
    ids = ()
  if not ids or any(i < 0 for i in ids):
    raise LaunchError(f"launch --local-device-ids={text!r}: expected comma-separated "
                      f"device numbers >= 0, e.g. 0,1,2,3")
  return ids


def check_coordinator(address: str) -> None:
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise LaunchError(f"launch --coordinator={address!r}: expected HOST:PORT with a port in "
                      f"1..65535, e.g. 10.0.0.1:1234")


def check_split(mesh_devices: int, num_processes: int, devices_per_process: int) -> None:
  """The processes' devices must cover the mesh, and every process must hold part of it
  (the mesh takes the first ``mesh.dp * mesh.tp`` devices, process by process)."""
  total = num_processes * devices_per_process
  if total < mesh_devices:
    raise LaunchError(
        f"launch: {num_processes} processes x {devices_per_process} devices = {total} "
        f"devices, but mesh.dp*mesh.tp = {mesh_devices}; raise --devices-per-process or "
        f"--processes")
  if (num_processes - 1) * devices_per_process >= mesh_devices:
    raise LaunchError(
        f"launch: {num_processes} processes x {devices_per_process} devices = {total} "
        f"devices, so process {num_processes - 1} would hold none of the mesh's "
        f"{mesh_devices} devices; use --devices-per-process "
        f"{-(-mesh_devices // num_processes)}")


def check_mesh_processes(device_processes: Sequence[int], num_processes: int) -> None:
  """Every process must hold a device of the mesh (``device_processes``: the process
  index of each mesh device); a process outside it could not join the computation."""
  idle = sorted(set(range(num_processes)) - set(device_processes))
  if idle:
    raise LaunchError(
        f"launch: process(es) {idle} of {num_processes} hold none of the mesh's "
        f"{len(device_processes)} devices; start fewer processes or give the mesh more "
        f"devices (mesh.dp, mesh.tp)")


def split_command(command: Sequence[str]) -> tuple[str, list[str]]:
  """``['run', CONFIG, ...]`` -> the verb and its arguments (LaunchError otherwise)."""
  if not command:
    raise LaunchError(f"launch: no command; give one of {list(LAUNCHABLE)} and its "
                      f"arguments, e.g. launch --processes 2 run CONFIG")
  verb, *rest = command
  if verb not in LAUNCHABLE:
    raise LaunchError(f"launch: verb {verb!r} cannot be launched; expected one of "
                      f"{list(LAUNCHABLE)}")
  if any(a == "--resume" or a.startswith("--resume=") for a in rest):
    raise LaunchError("launch: run --resume continues a checkpointed run, and only "
                      "single-process runs write checkpoints; use ula-jax run --resume DIR")
  return verb, rest


# ----------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------


def _run_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="ula-jax launch ... run")
  add_run_arguments(parser)
  return parser


def run_process(spec: ProcessSpec, command: Sequence[str]) -> int:
  """Joins the multi-process run as process ``spec.process_id`` and runs ``command``.

  Must be called before jax starts its backend (a fresh process). Returns 0; a failure
  after joining is printed as ``ula-jax`` prints it and ends the process at once with
  ``ula-jax``'s exit status (2 for config errors, 1 otherwise).
  """
  import jax

  from ula_jax.config import load_config
  from ula_jax.core.compat import distributed_client
  from ula_jax.mesh import build_mesh, configure_platform
  from ula_jax.run import run_experiment

  _, rest = split_command(command)
  check_coordinator(spec.coordinator)
  if not 0 <= spec.process_id < spec.num_processes:
    raise LaunchError(f"launch --process-id={spec.process_id}: expected 0..."
                      f"{spec.num_processes - 1} (--num-processes={spec.num_processes})")
  args = _run_parser().parse_args(rest)
  lead = spec.process_id == 0
  # The other processes' run directories are thrown away: skip their plots.
  cfg = load_config(args.config, list(args.overrides) + ([] if lead else
                                                          ["experiment.plots=false"]))
  per_process = spec.devices_per_process or -(-cfg.mesh.num_devices // spec.num_processes)
  configure_platform(cfg, num_devices=per_process)
  if cfg.mesh.platform in ("auto", "cpu"):
    # Exactly K simulated devices, whatever the environment asks for (only the CPU
    # backend reads it).
    jax.config.update("jax_num_cpu_devices", per_process)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  host = spec.coordinator.rpartition(":")[0]
  jax.distributed.initialize(
      spec.coordinator, spec.num_processes, spec.process_id,
      local_device_ids=spec.local_device_ids,
      # A coordinator on loopback serves this host only: listen there, not on every
      # interface (the default).
      coordinator_bind_address=spec.coordinator if host in LOOPBACK else None)
  client = distributed_client()
  ready = lambda: report_ready(client, spec.process_id, spec.num_processes)
  try:
    mesh = build_mesh(cfg)
    check_mesh_processes([d.process_index for d in mesh.devices.flat], spec.num_processes)
    if lead:
      run_experiment(cfg, out_dir=args.out, progress=not args.no_progress, mesh=mesh,
                     console=console(), overwrite=args.overwrite, ready=ready)
    else:
      from rich.console import Console

      with tempfile.TemporaryDirectory(prefix="ula-launch-") as scratch:
        run_experiment(cfg, out_dir=Path(scratch) / "run", progress=False, mesh=mesh,
                       show=False, console=Console(file=io.StringIO()), ready=ready)
  except BaseException as e:  # every failure ends the process the same way
    # Leave at once: the runtime's teardown at a normal exit waits for the other
    # processes, which wait in a collective for this one. Those still setting up learn
    # of this failure from the store (``report_ready``).
    code = _explain_failure(e)
    report_failure(client, spec.process_id, code, _one_line(e))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  jax.distributed.shutdown()
  return 0


def _one_line(e: BaseException) -> str:
  """The failure as the other processes are told it."""
  text = str(e).strip() or type(e).__name__
  return text if isinstance(e, (ValueError, PeerFailure)) else f"{type(e).__name__}: {text}"


def _explain_failure(e: BaseException) -> int:
  """Prints why a worker failed, as ``ula-jax`` would; returns its exit status."""
  from ula_jax.config import ConfigError
  from ula_jax.report.output import RunDirError, exit_status
  from ula_jax.workloads import WorkloadError

  if isinstance(e, (ConfigError, WorkloadError, RunDirError, LaunchError)):
    print(f"error: {e}", file=sys.stderr)
    return 2
  if isinstance(e, PeerFailure):
    print(f"error: launch: {e}", file=sys.stderr)
    return e.code
  if isinstance(e, SystemExit):
    return e.code if isinstance(e.code, int) else 1
  if isinstance(e, KeyboardInterrupt):
    print(f"interrupted ({e})", file=sys.stderr)
    return exit_status(e)
  traceback.print_exception(e)
  return 1


# ----------------------------------------------------------------------------------
# Local launcher
# ----------------------------------------------------------------------------------


def free_port(host: str = LOCALHOST) -> int:
  """A TCP port nothing listens on now (the coordinator binds it moments later)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind((host, 0))
    return s.getsockname()[1]


def worker_command(spec: ProcessSpec, command: Sequence[str]) -> list[str]:
  """The command line of one worker (``python -m ula_jax.cli.main launch ...``)."""
  argv = [sys.executable, "-m", "ula_jax.cli.main", "launch", "--coordinator", spec.coordinator,
          "--num-processes", str(spec.num_processes), "--process-id", str(spec.process_id)]
  if spec.devices_per_process is not None:
    argv += ["--devices-per-process", str(spec.devices_per_process)]
  if spec.local_device_ids is not None:
    argv += ["--local-device-ids", ",".join(map(str, spec.local_device_ids))]
  return argv + list(command)


def launch_local(num_processes: int, command: Sequence[str],
                 devices_per_process: int | None = None, *, poll_s: float = 0.2) -> int:
  """Spawns ``num_processes`` workers on this host running ``command`` and waits.

  Process 0 prints to this terminal; the others' stdout is dropped and their stderr is
  shown only when they fail. When one fails the others are stopped (they would wait in
  a collective forever) and its exit status is returned; 0 when all succeed.
  """
  from ula_jax.config import load_config

  if num_processes < 1:
    raise LaunchError(f"launch --processes={num_processes}: must be >= 1")
  if devices_per_process is not None and devices_per_process < 1:
    raise LaunchError(f"launch --devices-per-process={devices_per_process}: must be >= 1")
  _, rest = split_command(command)
  # Config errors surface here, once, before any process starts.
  args = _run_parser().parse_args(rest)
  cfg = load_config(args.config, args.overrides)
  if cfg.engine.checkpoint_every and num_processes > 1:
    raise LaunchError(f"launch: engine.checkpoint_every={cfg.engine.checkpoint_every}: "
                      f"checkpoints are written by single-process runs only; set "
                      f"engine.checkpoint_every=0")
  need = cfg.mesh.num_devices
  per_process = devices_per_process or -(-need // num_processes)
  check_split(need, num_processes, per_process)

  coordinator = f"{LOCALHOST}:{free_port()}"
  procs: list[subprocess.Popen] = []
  logs: list[Any] = []  # per process: its stderr file (None: the terminal)
  try:
    for i in range(num_processes):
      spec = ProcessSpec(coordinator, num_processes, i, per_process,
                         tuple(range(i * per_process, (i + 1) * per_process)))
      log = None if i == 0 else tempfile.TemporaryFile(mode="w+")
      logs.append(log)
      procs.append(subprocess.Popen(
          worker_command(spec, command), stdout=None if i == 0 else subprocess.DEVNULL,
          stderr=log))
    while True:
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        i, code = failed[0]
        _stop(procs)
        _report_failure(i, code, logs[i])
        return code if code > 0 else 1
      if all(c == 0 for c in codes):
        return 0
      time.sleep(poll_s)
  finally:
    _stop(procs)
    for log in logs:
      if log is not None:
        log.close()


def _stop(procs: list[subprocess.Popen]) -> None:
  for p in procs:
    if p.poll() is None:
      p.terminate()
  for p in procs:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


def _report_failure(i: int, code: int, log) -> None:
  status = f"status {code}" if code >= 0 else f"signal {-code}"
  print(f"error: launch: process {i} exited with {status}; stopped the other processes",
        file=sys.stderr)
  if log is not None:
    log.seek(0)
    tail = log.read().splitlines()[-STDERR_TAIL:]
    for line in tail:
      print(f"[process {i}] {line}", file=sys.stderr)
