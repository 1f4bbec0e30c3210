"""The run directory: config.yaml, metrics.jsonl, summary.json, requests.jsonl, run.png.

A run writes into a hidden sibling folder (``.NAME.partial-PID``) renamed into place when
it ends (``RunDirTarget``), so a run directory is never seen half written; an exclusive
lock (``DirLock``) keeps two runs from writing one directory. SIGINT and SIGTERM become
``RunInterrupted`` (``stop_on_signals``), which ends the engine's loop at a step boundary
and still writes the run directory.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any, Iterator, Mapping


from ula_jax.core.serialize import dumps
from ula_jax.engine.types import RunResult, StepMetrics
from ula_jax.report.stats import request_record, run_stats

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
REQUESTS_FILE = "requests.jsonl"
DIGESTS_FILE = "digests.npz"  # engine.record_digests
RUN_PLOT = "run.png"


def timestamp() -> str:
  return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def new_run_dir(parent: str | Path, name: str, stamp: str | None = None) -> Path:
  """A fresh, empty ``parent/name-YYYYmmdd-HHMMSS`` (``-2``, ``-3``... when it exists).

  stamp: the timestamp to use (default: now)

  The directory is created here, so a concurrent call can never get the same one.
  """
  base = Path(parent) / f"{name}-{stamp or timestamp()}"
  base.parent.mkdir(parents=True, exist_ok=True)
  path, i = base, 1
  while True:
    try:
      path.mkdir()
      return path
    except FileExistsError:  # taken (perhaps a moment ago, by another run): next suffix
      i += 1
      path = base.with_name(f"{base.name}-{i}")


class MetricsWriter:
  """Streams one JSON line per StepMetrics to ``metrics.jsonl`` (flushed per step, so
  a run can be watched with ``tail -f``)."""

  def __init__(self, path: str | Path):
    self.path = Path(path)
    self._f: IO[str] | None = None

  def __enter__(self) -> MetricsWriter:
    self._f = self.path.open("w")
    return self

  def write(self, m: StepMetrics) -> None:
    self._f.write(dumps(m.as_dict()) + "\n")
    self._f.flush()

  def __exit__(self, *exc) -> None:
    self._f.close()


def read_metrics(path: str | Path) -> list[dict]:
  return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_status(result: RunResult) -> str:
  """``"interrupted"`` when SIGINT or SIGTERM stopped the engine, else ``"finished"`` (the
  run ended; requests it could not serve are ``rejected`` with a reason)."""
  return "interrupted" if result.summary.get("interrupted_by") else "finished"


def write_summary(run_dir: str | Path, result: RunResult, name: str = "",
                  stats: dict | None = None,
                  prompts: Mapping[str, Any] | None = None) -> Path:
  """``summary.json``: the run's status (``interrupted_by`` when interrupted), derived
  stats, the engine's summary, capacity at the peak of device use, and every request's
  id, prompt length and hash, status, reason and generated tokens.

  prompts: request id -> prompt tokens, for each request's ``prompt_sha1`` (null without)
  """
  path = Path(run_dir) / SUMMARY_FILE
  prompts = prompts or {}
  doc = {
      "experiment": name,
      "status": run_status(result),
      **({"interrupted_by": result.summary["interrupted_by"]}
         if result.summary.get("interrupted_by") else {}),
      "stats": stats if stats is not None else run_stats(result),
      "summary": result.summary,
      "capacity": result.capacity,
      "requests": [request_record(r, prompts.get(r.id)) for r in result.requests],
  }
  path.write_text(dumps(doc, indent=1) + "\n")
  return path


def write_requests(run_dir: str | Path, result: RunResult) -> Path:
  """``requests.jsonl``: every RequestResult (timings included), one per line."""
  path = Path(run_dir) / REQUESTS_FILE
  with path.open("w") as f:
    for r in result.requests:
      f.write(dumps(r.as_dict()) + "\n")
  return path


class RunDirError(ValueError):
  """A run directory without a readable summary."""


def read_summary(run_dir: str | Path) -> dict:
  """The ``summary.json`` of a run directory (RunDirError naming the file if unreadable)."""
  path = Path(run_dir) / SUMMARY_FILE
  if not path.is_file():
    raise RunDirError(f"{run_dir}: not a run directory (no {SUMMARY_FILE})")
  try:
    doc = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise RunDirError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None
  if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
    raise RunDirError(f"{path}: expected an object with a 'requests' list")
  return doc


def write_outputs(run_dir: str | Path, result: RunResult, *, name: str = "",
                  plots: bool = True, prompts: Mapping[str, Any] | None = None) -> dict:
  """summary.json, requests.jsonl and (``plots``) run.png; returns the run's stats.

  prompts: request id -> prompt tokens (``prompt_sha1`` in summary.json)
  """
  from ula_jax.report.plots import plot_run  # matplotlib only when plotting

  run_dir = Path(run_dir)
  stats = run_stats(result)
  write_summary(run_dir, result, name=name, stats=stats, prompts=prompts)
  write_requests(run_dir, result)
  if plots and result.steps:
    plot_run(result.steps, run_dir / RUN_PLOT, title=name,
             device_capacity=stats["device_capacity"], host_capacity=stats["host_capacity"])
  return stats


# ----------------------------------------------------------------------------------
# Writing run directories safely
# ----------------------------------------------------------------------------------

# Files that mark a directory as a run or sweep directory: only those may be replaced
# (--overwrite), so a mistyped --out can never wipe unrelated files.
RUN_MARKERS = (CONFIG_FILE, SUMMARY_FILE, METRICS_FILE, "sweep.json")


class DirLock:
  """An exclusive, non-blocking lock on a directory to be written: ``flock`` on the
  sibling file ``.NAME.lock``.

  The kernel drops an flock when its holder exits, however it ends (even ``kill -9``), so
  a crashed run never leaves a stale lock behind, unlike a lock that is merely a file's
  existence. ``release`` removes the file; ``acquire`` makes sure the file it locked is
  still the one at the path (a holder may remove it between another's open and lock).
  """

  def __init__(self, target: str | Path):
    target = Path(os.path.abspath(target))
    self.path = target.parent / f".{target.name}.lock"
    self._fd: int | None = None

  def acquire(self) -> bool:
    """True when this process now holds the lock; False when another holds it."""
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        return False
      except OSError as e:
        os.close(fd)
        raise RunDirError(f"{self.path}: cannot lock ({e.strerror}); the file system must "
                          f"support flock") from None
      try:
        same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
      except FileNotFoundError:
        same = False
      if same:
        self._fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return True
      os.close(fd)  # locked a file its holder had just removed: lock the current one

  def holder(self) -> str:
    """The holder's pid as it wrote it (for messages), or '?'."""
    try:
      return self.path.read_text().strip() or "?"
    except OSError:
      return "?"

  def release(self) -> None:
    if self._fd is None:
      return
    # Removed while still held: a process waiting on the old file re-checks and retries.
    with contextlib.suppress(FileNotFoundError):
      os.unlink(self.path)
    os.close(self._fd)
    self._fd = None

  def __del__(self) -> None:
    # Dropped while held (a sweep that returned or raised): release it then.
    try:
      self.release()
    except (OSError, TypeError):  # at interpreter shutdown; the kernel releases it anyway
      return


def _is_empty_dir(path: Path) -> bool:
  return not any(path.iterdir())


def _holds_a_run(path: Path) -> bool:
  """A run directory, or a sweep directory (also one whose sweep stopped before it wrote
  sweep.json: run directories one level down)."""
  return (any((path / m).exists() for m in RUN_MARKERS)
          or any((d / CONFIG_FILE).is_file() for d in path.iterdir() if d.is_dir()))


def check_out_dir(path: str | Path, *, overwrite: bool = False, flag: str = "--out") -> Path:
  """Refuses an output directory that cannot be (re)written; returns it, absolute.

  Refused (RunDirError naming ``flag``, the path and what to do): an existing file; a
  non-empty directory without ``overwrite``; with ``overwrite``, a non-empty directory
  that holds no run (none of RUN_MARKERS) or holds the working directory; a path whose
  parent cannot be created or is not writable. Creates the missing parents.
  """
  path = Path(os.path.abspath(path))
  where = f"{flag} {path}"
  if path.exists() and not path.is_dir():
    raise RunDirError(f"{where}: exists and is not a directory; give a directory path")
  if path.is_dir() and not _is_empty_dir(path):
    if not overwrite:
      raise RunDirError(f"{where}: exists and is not empty; give --overwrite to replace "
                        f"its contents, or another directory")
    if not _holds_a_run(path):
      raise RunDirError(f"{where}: is not empty and holds no run (none of "
                        f"{', '.join(RUN_MARKERS)}, nor a run directory); --overwrite "
                        f"replaces only run and sweep directories; empty it yourself or "
                        f"choose another")
    cwd = Path.cwd()
    if path == cwd or path in cwd.parents:
      raise RunDirError(f"{where}: holds the working directory; --overwrite would remove "
                        f"it; choose another directory")
  make_writable_dir(path.parent, where)
  return path


def make_writable_dir(path: Path, where: str) -> None:
  """Creates ``path`` (and its parents) unless it exists; RunDirError starting with
  ``where`` unless it is then a directory this process may create entries in."""
  ancestor = path
  while not ancestor.exists():
    ancestor = ancestor.parent
  if not ancestor.is_dir():
    raise RunDirError(f"{where}: cannot be created: {ancestor} is a file, not a directory")
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise RunDirError(f"{where}: cannot create {path}: {e.strerror}") from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise RunDirError(f"{where}: cannot be created: {path} is not writable")


def claim_dir(path: Path, flag: str) -> DirLock:
  """The lock on ``path`` (absolute), or RunDirError when another run holds it."""
  lock = DirLock(path)
  try:
    acquired = lock.acquire()
  except OSError as e:  # (RunDirError, a ValueError, passes)
    raise RunDirError(f"{flag} {path}: cannot create the lock file {lock.path}: "
                      f"{e.strerror}") from None
  if not acquired:
    raise RunDirError(f"{flag} {path}: another run (pid {lock.holder()}) is writing it "
                      f"(lock {lock.path}); wait for it to end or choose another directory")
  return lock


def _remove(path: Path) -> None:
  """Removes a directory aside: renamed first, so it vanishes in one step."""
  doomed = path.with_name(f".{path.name}.old-{os.getpid()}")
  os.rename(path, doomed)
  shutil.rmtree(doomed, ignore_errors=True)


class RunDirTarget:
  """Where one run writes: ``partial`` (a hidden sibling of the run directory) while it
  runs, renamed to the run directory by ``commit``.

  Readers thus see no run directory, or a complete one. With an explicit directory the
  lock (``DirLock``) is held from ``claim`` until ``commit`` or ``abandon``: a second run
  into it is refused, never interleaved. The default directory
  (``{parent}/{name}-{timestamp}``) is reserved with ``new_run_dir`` at commit, so
  concurrent runs each get their own.
  """

  def __init__(self, final: Path | None, partial: Path, lock: DirLock | None,
               default: tuple[Path, str, str] | None = None, overwrite: bool = False):
    self.final = final
    self.partial = partial
    self._lock = lock
    self._default = default
    self._overwrite = overwrite
    self.shown: Path | None = None  # the run directory as the caller named it
    self._keep = False

  @classmethod
  def claim(cls, out_dir: str | Path | None, *, parent: str | Path, name: str,
            overwrite: bool = False, flag: str = "--out") -> RunDirTarget:
    """Checks ``out_dir`` (``check_out_dir``), locks it and creates the partial folder.
    None: the default ``{parent}/{name}-{timestamp}`` (timestamp of now)."""
    pid = os.getpid()
    if out_dir is None:
      stamp = timestamp()
      parent_given, parent = parent, Path(os.path.abspath(parent))
      make_writable_dir(parent, f"experiment.out_dir={str(parent)!r}")
      # (mkdtemp: unique even for runs of one process started in the same second)
      partial = Path(tempfile.mkdtemp(prefix=f".{name}-{stamp}.partial-{pid}-", dir=parent))
      # (new_run_dir gets the parent as given: the run directory is shown as written)
      return cls(None, partial, None, default=(Path(parent_given), name, stamp))
    final = check_out_dir(out_dir, overwrite=overwrite, flag=flag)
    lock = claim_dir(final, flag)
    try:
      # Checked again under the lock: another run may have written it meanwhile.
      final = check_out_dir(final, overwrite=overwrite, flag=flag)
      # Partial folders of runs that died (the lock is free, so no run writes them).
      for stale in final.parent.glob(f".{final.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
      partial = final.parent / f".{final.name}.partial-{pid}"
      partial.mkdir()
    except BaseException:
      lock.release()
      raise
    target = cls(final, partial, lock, overwrite=overwrite)
    target.shown = Path(out_dir)
    return target

  def commit(self) -> Path:
    """Renames the partial folder to the run directory (replacing the old contents with
    ``overwrite``) and releases the lock; returns the run directory."""
    try:
      if self._default is not None:
        self.final = new_run_dir(*self._default)  # empty: the rename replaces it
      try:
        os.rename(self.partial, self.final)  # atomic; over a missing or empty directory
      except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not self._overwrite:
          self._keep = True  # the finished run stays where the message says
          raise RunDirError(f"{self.final}: cannot move the finished run into place "
                            f"({e.strerror}); it is in {self.partial}") from None
        _remove(self.final)
        os.rename(self.partial, self.final)
    finally:
      self._release()
    return self.shown or self.final

  def abandon(self) -> None:
    """Removes the partial folder (the run failed) and releases the lock."""
    if not self._keep:
      shutil.rmtree(self.partial, ignore_errors=True)
    self._release()

  def _release(self) -> None:
    if self._lock is not None:
      self._lock.release()
      self._lock = None


def claim_sweep_dir(out: str | Path, *, overwrite: bool = False) -> tuple[Path, DirLock]:
  """A sweep directory, empty and locked for the whole sweep (``release`` the lock at
  its end): refused like ``check_out_dir``; with ``overwrite`` the old contents are
  removed first. Its run directories are then written each like any run's."""
  path = check_out_dir(out, overwrite=overwrite)
  lock = claim_dir(path, "--out")
  try:
    path = check_out_dir(path, overwrite=overwrite)
    if path.is_dir() and not _is_empty_dir(path):
      _remove(path)
    path.mkdir(exist_ok=True)
  except OSError as e:
    lock.release()
    raise RunDirError(f"--out {path}: cannot create it: {e.strerror}") from None
  except BaseException:
    lock.release()
    raise
  return path, lock


# ----------------------------------------------------------------------------------
# Interrupts
# ----------------------------------------------------------------------------------


class RunInterrupted(KeyboardInterrupt):
  """SIGINT or SIGTERM as an exception (a KeyboardInterrupt, so code that handles Ctrl-C
  handles both). ``run_dir``: the interrupted run's directory, once written."""

  def __init__(self, signum: int, run_dir: Path | None = None):
    self.signum = int(signum)
    self.signal_name = signal.Signals(signum).name
    self.run_dir = run_dir
    super().__init__(self.signal_name)

  @property
  def exit_status(self) -> int:
    """The shell's convention: 128 + the signal number (130 SIGINT, 143 SIGTERM)."""
    return 128 + self.signum


def exit_status(e: KeyboardInterrupt) -> int:
  """130 for a plain KeyboardInterrupt, else ``RunInterrupted.exit_status``."""
  return e.exit_status if isinstance(e, RunInterrupted) else 128 + signal.SIGINT


class StopRequest:
  """A signal handler for a run: the first SIGINT/SIGTERM is noted (``check`` raises it
  at the next step boundary, where the engine's state is consistent); a second one
  raises at once, unless ``finishing`` (the results are being written: nothing is
  raised, the writing must not be cut short)."""

  def __init__(self) -> None:
    self.signum: int | None = None
    self.finishing = False

  def __call__(self, signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    if self.finishing:
      self.signum = self.signum or signum
      sys.stderr.write(f"\n{name}: writing the run directory first\n")
      return
    if self.signum is not None:
      raise RunInterrupted(signum)
    self.signum = signum
    sys.stderr.write(f"\n{name}: stopping after this engine step (send it again to stop "
                     f"at once)\n")

  def check(self) -> None:
    if self.signum is not None:
      raise RunInterrupted(self.signum)


@contextlib.contextmanager
def handle_signals(handler: Any, signums=(signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
  """``handler`` for ``signums`` within the block, the previous handlers after it. Only
  the main thread may set handlers; elsewhere the block runs with them unchanged."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = {s: signal.signal(s, handler) for s in signums}
  try:
    yield
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


def raise_interrupted(signum: int, frame: Any) -> None:
  """A signal handler: raises RunInterrupted where the program is."""
  raise RunInterrupted(signum)
