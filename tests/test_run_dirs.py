"""Run directories written safely: --out refusals and --overwrite, the partial folder
renamed into place, the lock against a second writer, and SIGINT / SIGTERM ending a run
with its directory written (``"status": "interrupted"``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ula_jax.cli.main import EXIT_USAGE, main
from ula_jax.config.loader import REPO_CONFIGS
from ula_jax.report.output import (DirLock, RunDirError, RunDirTarget, check_out_dir,
                                   claim_sweep_dir, new_run_dir)

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = str(REPO_CONFIGS.parent / "experiments" / "quickstart" / "config.yaml")


def _old_run(path: Path) -> Path:
  path.mkdir(parents=True)
  (path / "config.yaml").write_text("old: run\n")
  (path / "summary.json").write_text("{}\n")
  return path


def _unwritable(tmp_path: Path) -> Path:
  """A run directory path whose parent cannot be created or written."""
  if os.geteuid() == 0:  # root writes anywhere; /proc takes no new entries
    return Path("/proc/ula-jax-test-nonexistent/run")
  ro = tmp_path / "ro"
  ro.mkdir(mode=0o500)
  return ro / "sub" / "run"


# ----------------------------------------------------------------------------------
# --out checks
# ----------------------------------------------------------------------------------


def test_check_out_dir_refusals(tmp_path, monkeypatch):
  file = tmp_path / "file"
  file.write_text("")
  with pytest.raises(RunDirError, match=rf"--out {file}: exists and is not a directory"):
    check_out_dir(file)
  with pytest.raises(RunDirError, match=rf"{file} is a file, not a directory"):
    check_out_dir(file / "run")
  old = _old_run(tmp_path / "old")
  with pytest.raises(RunDirError, match=rf"--out {old}: exists and is not empty; give "
                     r"--overwrite"):
    check_out_dir(old)
  assert check_out_dir(old, overwrite=True) == old
  other = tmp_path / "notes"
  other.mkdir()
  (other / "notes.txt").write_text("keep me")
  with pytest.raises(RunDirError, match=r"holds no run .*--overwrite replaces only run"):
    check_out_dir(other, overwrite=True)
  # A sweep stopped before its sweep.json: its run directories mark it.
  _old_run(tmp_path / "sweep" / "000-seed=0")
  assert check_out_dir(tmp_path / "sweep", overwrite=True) == tmp_path / "sweep"
  here = _old_run(tmp_path / "here") / "sub"
  here.mkdir()
  monkeypatch.chdir(here)
  with pytest.raises(RunDirError, match=r"holds the working directory; --overwrite would "
                     r"remove it"):
    check_out_dir(tmp_path / "here", overwrite=True)
  with pytest.raises(RunDirError, match=r"cannot (be created|create)"):
    check_out_dir(_unwritable(tmp_path))
  empty = tmp_path / "empty"
  empty.mkdir()
  assert check_out_dir(empty) == empty
  assert check_out_dir(tmp_path / "a" / "b" / "run") == tmp_path / "a" / "b" / "run"
  assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "b" / "run").exists()


@pytest.mark.parametrize("case", ["non-empty", "file", "unwritable", "locked"])
def test_run_and_sweep_refuse_their_out_with_exit_2(tmp_path, capsys, case):
  if case == "non-empty":
    out, match = _old_run(tmp_path / "out"), r"exists and is not empty; give --overwrite"
  elif case == "file":
    out, match = tmp_path / "out", r"exists and is not a directory"
    out.write_text("")
  elif case == "unwritable":
    out, match = _unwritable(tmp_path), r"cannot (be created|create)"
  else:
    out, match = tmp_path / "out", r"another run \(pid \d+\) is writing it"
    lock = DirLock(out)
    assert lock.acquire()
  for argv in (["run", QUICKSTART, "--out", str(out)],
               ["sweep", QUICKSTART, "engine.max_batch=1,2", "--out", str(out)]):
    assert main([*argv, "--no-progress"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert str(out) in err and re.search(match, err), err
  if case == "non-empty":  # nothing of the old run was touched
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "summary.json"]
  if case == "locked":
    lock.release()
    assert not lock.path.exists()


# ----------------------------------------------------------------------------------
# the partial folder and the lock
# ----------------------------------------------------------------------------------


def test_a_run_directory_appears_only_when_complete(tmp_path):
  final = tmp_path / "run"
  target = RunDirTarget.claim(final, parent=tmp_path, name="exp")
  assert target.partial.parent == tmp_path and target.partial.name.startswith(".run.partial-")
  (target.partial / "summary.json").write_text("{}")
  assert not final.exists()
  # A second writer is refused while the first holds the directory.
  with pytest.raises(RunDirError, match=rf"--out {final}: another run \(pid {os.getpid()}\)"):
    RunDirTarget.claim(final, parent=tmp_path, name="exp")
  assert target.commit() == final
  assert [p.name for p in final.iterdir()] == ["summary.json"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no partial, no lock
  # Failed: nothing is left behind.
  failed = RunDirTarget.claim(tmp_path / "failed", parent=tmp_path, name="exp")
  failed.abandon()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_overwrite_replaces_the_old_run_when_the_new_one_ends(tmp_path):
  final = _old_run(tmp_path / "run")
  with pytest.raises(RunDirError, match=r"give --overwrite"):
    RunDirTarget.claim(final, parent=tmp_path, name="exp")
  # A partial folder of a run that died: removed by the next run that holds the lock.
  (tmp_path / ".run.partial-1").mkdir()
  target = RunDirTarget.claim(final, parent=tmp_path, name="exp", overwrite=True)
  assert not (tmp_path / ".run.partial-1").exists()
  assert (final / "config.yaml").read_text() == "old: run\n"  # kept until the end
  (target.partial / "metrics.jsonl").write_text("")
  target.commit()
  assert [p.name for p in final.iterdir()] == ["metrics.jsonl"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_default_run_directories_never_collide(tmp_path):
  targets = [RunDirTarget.claim(None, parent=tmp_path / "runs", name="exp") for _ in range(3)]
  dirs = [t.commit() for t in targets]
  assert len(set(dirs)) == 3 and all(d.is_dir() and d.parent == tmp_path / "runs" for d in dirs)
  assert all(re.fullmatch(r"exp-\d{8}-\d{6}(-\d)?", d.name) for d in dirs)
  assert not [p for p in (tmp_path / "runs").iterdir() if p.name.startswith(".")]
  a, b = new_run_dir(tmp_path, "x", stamp="s"), new_run_dir(tmp_path, "x", stamp="s")
  assert (a.name, b.name) == ("x-s", "x-s-2")


def test_sweep_dir_is_locked_and_overwrite_empties_it(tmp_path):
  out = tmp_path / "sweep"
  path, lock = claim_sweep_dir(out)
  assert path == out and out.is_dir()
  with pytest.raises(RunDirError, match=r"another run .* is writing it"):
    claim_sweep_dir(out)
  (out / "sweep.json").write_text("{}")
  lock.release()
  with pytest.raises(RunDirError, match=r"give --overwrite"):
    claim_sweep_dir(out)
  _, lock = claim_sweep_dir(out, overwrite=True)
  assert list(out.iterdir()) == []
  lock.release()


# ----------------------------------------------------------------------------------
# SIGINT / SIGTERM (a real run in a subprocess)
# ----------------------------------------------------------------------------------


def _env() -> dict[str, str]:
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                            env.get("XLA_FLAGS", ""))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
  cache = os.environ.get("ULA_JAX_TEST_COMPILATION_CACHE")
  if cache:  # the session's compilation cache (tests/conftest.py): the second run loads
    env["JAX_COMPILATION_CACHE_DIR"] = cache
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"
  return env


@pytest.mark.parametrize("signum,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_run_with_its_directory_written(tmp_path, signum, status):
  out = tmp_path / "run"
  # One dp rank serving one request at a time: a few hundred steps, far more than the
  # run gets before the signal. Dense MLPs (how a run ends does not depend on them): a
  # shorter compile before the first step.
  argv = [sys.executable, "-m", "ula_jax.cli.main", "run", QUICKSTART, "mesh=dp1",
          "engine.max_batch=1", "workload.num_requests=8", "experiment.plots=false",
          "model.num_dense_layers=4", "--no-progress", "--out", str(out)]
  proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 120
    metrics = None
    while metrics is None and proc.poll() is None and time.monotonic() < deadline:
      metrics = next(iter(tmp_path.glob(".run.partial-*/metrics.jsonl")), None)
      if metrics is not None and not metrics.read_text().strip():
        metrics = None
      time.sleep(0.05)
    assert metrics is not None, "no metrics line before the run ended"
    assert not out.exists()  # still in the partial folder
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  name = signal.Signals(signum).name
  assert proc.returncode == status, stderr[-3000:]
  assert "Traceback" not in stderr, stderr[-3000:]
  assert f"interrupted ({name}); run directory written: {out}" in stderr

  doc = json.loads((out / "summary.json").read_text())
  assert doc["status"] == "interrupted" and doc["interrupted_by"] == name
  reqs = doc["requests"]
  assert len(reqs) == 8
  assert {r["status"] for r in reqs} <= {"finished", "interrupted"}
  assert any(r["status"] == "interrupted" for r in reqs)
  for r in reqs:
    if r["status"] == "finished":
      assert len(r["output_tokens"]) == r["max_new_tokens"]
    else:
      assert len(r["output_tokens"]) < r["max_new_tokens"]
      assert r["reason"].startswith(f"interrupted by {name}")
  lines = (out / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == doc["stats"]["steps"] >= 1
  assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
