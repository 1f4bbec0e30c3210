"""Multi-process runs (``ula-jax launch``): four jax.distributed processes of two CPU
devices each decode exactly the tokens one process with eight devices decodes.

The processes talk over loopback only (gloo collectives, a coordinator on 127.0.0.1).
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest

from ula_jax.cli.main import EXIT_OK, EXIT_USAGE, main
from ula_jax.config.loader import REPO_CONFIGS
from ula_jax.cli.launch import LaunchError, check_mesh_processes, check_split, launch_local
from ula_jax.report import read_summary

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO_CONFIGS.parent / "experiments" / "quickstart" / "config.yaml")
# Short requests of the tiny model, every layer dense (the MLP is not what crosses
# processes; the MoE layers' code would only make each process compile longer).
SMALL = ["workload.output_len=[6,10]", "experiment.plots=false", "model.num_dense_layers=4"]
# A (dp=2, tp=4) mesh over four processes of two devices: process p holds tp ranks
# 2(p%2), 2(p%2)+1 of dp rank p//2. Each dp rank's heads are split over two processes
# (every layer's attention output is gathered across them), and the two dp ranks serve
# their own requests in different processes: one run crosses processes on both axes.
MESH = ["mesh.dp=2", "mesh.tp=4", "workload.num_requests=4"]
PROCESSES, DEVICES_PER_PROCESS = 4, 2


def _worker_env() -> dict[str, str]:
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  # The launcher sets each process's device count; an inherited XLA flag must not.
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                            env.get("XLA_FLAGS", ""))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
  return env


def _tokens(run_dir: Path) -> dict[str, list[int]]:
  doc = read_summary(run_dir)
  assert [r["status"] for r in doc["requests"]] == ["finished"] * len(doc["requests"])
  return {r["id"]: r["output_tokens"] for r in doc["requests"]}


def test_processes_decode_the_tokens_of_one(tmp_path, capfd, monkeypatch):
  args = [QUICKSTART, *SMALL, *MESH, "--no-progress"]
  multi, single = tmp_path / "multi", tmp_path / "single"
  t0 = time.perf_counter()
  # The launcher (what ``ula-jax launch --processes`` runs) in a thread of this process:
  # it starts the four processes and waits for them, while this thread runs the
  # one-process run (this process has 8 CPU devices). The processes inherit this
  # process's environment (tests/conftest.py: CPU, the compiler settings), as
  # ``_worker_env`` gives it.
  for name, value in _worker_env().items():
    monkeypatch.setenv(name, value)
  launched = {}

  def launch():
    try:
      launched["code"] = launch_local(PROCESSES, ["run", *args, "--out", str(multi)],
                                      DEVICES_PER_PROCESS)
    except BaseException as e:  # reported below
      launched["error"] = e

  thread = threading.Thread(target=launch, daemon=True)
  thread.start()
  try:
    assert main(["run", *args, "--out", str(single)]) == EXIT_OK
  finally:
    thread.join(timeout=240)
  assert not thread.is_alive(), "the launched processes did not end"
  out, err = capfd.readouterr()
  assert "error" not in launched, launched.get("error")
  assert launched["code"] == 0, err[-4000:]
  assert f"run directory: {multi}" in out  # process 0 printed the table
  print(f"both runs took {time.perf_counter() - t0:.1f}s")

  assert _tokens(multi) == _tokens(single)
  doc, ref = read_summary(multi), read_summary(single)
  assert doc["summary"]["processes"] == PROCESSES and ref["summary"]["processes"] == 1
  assert (doc["summary"]["dp"], doc["summary"]["tp"]) == (ref["summary"]["dp"],
                                                          ref["summary"]["tp"]) == (2, 4)
  # The accounting read from state spread over the processes is the whole mesh's.
  assert doc["capacity"] == ref["capacity"]
  # Only process 0 wrote a run directory.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["multi", "single"]


def test_a_failing_process_stops_the_others(tmp_path, capfd):
  blocker = tmp_path / "file"
  blocker.write_text("")
  t0 = time.perf_counter()
  # Process 0 fails creating its run directory (under a file); process 1 would then
  # wait for it in a collective.
  code = main(["launch", "--processes", "2", "run", QUICKSTART, *SMALL, "mesh.dp=2",
               "workload.num_requests=2", "--no-progress", "--out", str(blocker / "run")])
  assert code == 2
  err = capfd.readouterr().err
  assert "is a file, not a directory" in err  # process 0's own report of what went wrong
  assert re.search(r"error: launch: process 0 exited with status 2; stopped the other "
                   r"processes", err), err[-3000:]
  # Nobody waited for a peer's timeout (the runtime's are 100 s and more).
  assert time.perf_counter() - t0 < 90


@pytest.mark.parametrize("argv,match", [
    (["run", QUICKSTART], r"launch: give --processes N \(all processes on this host\), or "
     r"--coordinator HOST:PORT, --num-processes N and --process-id I"),
    (["--processes", "2", "--process-id", "0", "run", QUICKSTART],
     r"--processes starts every process here; it cannot be combined with --coordinator"),
    (["--processes", "0", "run", QUICKSTART], r"launch --processes=0: must be >= 1"),
    (["--processes", "2", "--devices-per-process", "0", "run", QUICKSTART],
     r"launch --devices-per-process=0: must be >= 1"),
    (["--processes", "2"], r"launch: no command; give one of \['run'\]"),
    (["--processes", "2", "sweep", QUICKSTART, "engine.max_batch=1,2"],
     r"launch: verb 'sweep' cannot be launched; expected one of \['run'\]"),
    (["--processes", "2", "--devices-per-process", "2", "run", QUICKSTART],
     r"launch: 2 processes x 2 devices = 4 devices, but mesh.dp\*mesh.tp = 8"),
    (["--processes", "3", "--devices-per-process", "4", "run", QUICKSTART],
     r"process 2 would hold none of the mesh's 8 devices; use --devices-per-process 3"),
    (["--processes", "2", "run", QUICKSTART, "memory.polcy=lru"],
     r"unknown field 'memory.polcy'"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0", "run",
      QUICKSTART], r"launch --coordinator='localhost': expected HOST:PORT"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2", "run",
      QUICKSTART], r"launch --process-id=2: expected 0...1 \(--num-processes=2\)"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "0", "--process-id", "0", "run",
      QUICKSTART], r"launch --num-processes=0: must be >= 1"),
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0",
      "--local-device-ids", "0,x", "run", QUICKSTART],
     r"launch --local-device-ids='0,x': expected comma-separated device numbers"),
])
def test_launch_errors_exit_2_before_starting_anything(capsys, argv, match):
  assert main(["launch", *argv]) == EXIT_USAGE
  err = capsys.readouterr().err
  assert err.startswith("error: ")
  assert re.search(match, err), err


def test_layout_checks():
  check_split(8, 2, 4)
  check_split(6, 2, 4)  # the mesh takes 6 of 8 devices; both processes hold some
  with pytest.raises(LaunchError, match=r"3 processes x 2 devices = 6 devices, but "
                     r"mesh.dp\*mesh.tp = 8"):
    check_split(8, 3, 2)
  check_mesh_processes([0, 0, 1, 1], 2)
  with pytest.raises(LaunchError, match=r"launch: process\(es\) \[1, 2\] of 3 hold none of "
                     r"the mesh's 4 devices"):
    check_mesh_processes([0, 0, 0, 0], 3)


def test_processes_started_apart_stop_when_one_fails_its_setup(tmp_path):
  """Workers started with --coordinator (one per host; no launcher watches them):
  process 1 fails before its first step (its engine refuses the config, as a device
  with less free memory than the others' would); process 0 learns it from the
  coordinator's store and stops at once, naming it, instead of waiting for process 1 in
  the first collective (30 s on CPU, then an error that names no process)."""
  import subprocess

  from ula_jax.cli.launch import ProcessSpec, free_port, worker_command
  # Process 1's engine refuses its config: a sitecustomize on its path replaces it.
  fault = tmp_path / "fault"
  fault.mkdir()
  (fault / "sitecustomize.py").write_text(
      "import ula_jax.engine\n"
      "from ula_jax.config import ConfigError\n"
      "def _refuse(*args, **kwargs):\n"
      "  raise ConfigError(['memory.device_pool=64: does not fit on this host'])\n"
      "ula_jax.engine.Engine = _refuse\n")
  coordinator = f"127.0.0.1:{free_port()}"
  command = ["run", QUICKSTART, *SMALL, "mesh.dp=2", "workload.num_requests=2",
             "--no-progress", "--out", str(tmp_path / "run")]
  envs = [_worker_env(), _worker_env()]
  envs[1]["PYTHONPATH"] = os.pathsep.join([str(fault), envs[1]["PYTHONPATH"]])
  t0 = time.perf_counter()
  procs = [subprocess.Popen(worker_command(ProcessSpec(coordinator, 2, i, 1, (i,)), command),
                            env=envs[i], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True) for i in range(2)]
  try:
    errs = [p.communicate(timeout=120)[1] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  assert [p.returncode for p in procs] == [2, 2], errs
  assert "error: invalid config: memory.device_pool=64: does not fit on this host" in errs[1]
  assert ("error: launch: process 1 failed before the first step: invalid config: "
          "memory.device_pool=64: does not fit on this host") in errs[0], errs[0][-3000:]
  assert time.perf_counter() - t0 < 60
  assert not (tmp_path / "run").exists()


class _Store:
  """A stand-in for jax.distributed's key-value client."""

  def __init__(self, **found):
    self.found = {f"ula_jax/launch/ready/{k[1:]}": v for k, v in found.items()}

  def key_value_set(self, key, value):
    assert key not in self.found
    self.found[key] = value

  def key_value_dir_get(self, prefix):
    return [(k, v) for k, v in self.found.items() if k.startswith(prefix)]


def test_report_ready_waits_for_every_process_and_names_failures():
  from ula_jax.cli.launch import PeerFailure, report_failure, report_ready
  store = _Store(p1="ok", p2="ok")
  report_ready(store, 0, 3, timeout_s=5)
  assert store.found["ula_jax/launch/ready/0"] == "ok"
  store = _Store(p2="2\ninvalid config: memory.device_pool='52GiB': too large")
  with pytest.raises(PeerFailure, match=r"^process 2 failed before the first step: invalid "
                     r"config: memory.device_pool='52GiB': too large$") as e:
    report_ready(store, 0, 3, timeout_s=5)  # process 1 has not reported: no need to wait
  assert e.value.code == 2
  with pytest.raises(PeerFailure, match=r"process\(es\) \[1, 2\] reported neither a finished "
                     r"setup nor a failure within 0 s") as e:
    report_ready(_Store(), 0, 3, timeout_s=0.1, poll_s=0.01)
  assert e.value.code == 1
  store = _Store(p0="ok")
  report_failure(store, 0, 1, "late")  # already reported: nothing to tell
  report_failure(store, 1, 1, "RuntimeError: boom")
  assert store.found["ula_jax/launch/ready/1"] == "1\nRuntimeError: boom"
