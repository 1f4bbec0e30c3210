"""Checkpoints and ``ula-jax run --resume``: a run stopped by SIGTERM after a few steps
and resumed from its checkpoint decodes exactly the tokens of the run left alone
(resident and ula end to end; every memory system's state comes back bit for bit, in its
memory kind); every way a resume can be refused exits 2 with a message."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import jax
import numpy as np
import pytest

import ula_jax.run
from ula_jax.cli.main import EXIT_USAGE, main
from ula_jax.config import config_to_yaml, load_config
from ula_jax.config.loader import REPO_CONFIGS
from ula_jax.engine import Engine, RunState, checkpoint
from ula_jax.report import MetricsWriter
from ula_jax.report.output import DirLock, RunInterrupted
from ula_jax.run import run_experiment
from ula_jax.workloads import build_requests

QUICKSTART = str(REPO_CONFIGS.parent / "experiments" / "quickstart" / "config.yaml")
# Two dp ranks of one decode row for four requests of 2-4 prefill chunks: at the first
# interrupt one request per rank is half prefilled, the others queue. Every layer of the
# tiny model is dense: a checkpoint holds the run's state, not the parameters, and the
# kind of MLP changes nothing here but the compile time.
COMMON = ["model.num_dense_layers=4", "mesh.dp=2", "engine.max_batch=1",
          "workload.num_requests=4", "workload.output_len=[5,8]", "engine.prefill_chunk=64",
          "engine.page_size=16", "experiment.plots=false", "engine.progress=false"]
SYSTEMS = {
    "resident": [],
    # A device pool of 16 entries per group: most selections miss, entries move to and
    # from the pinned_host pool.
    "ula": ["memory.system=ula", "memory.device_pool=16", "memory.host_pool=1024"],
    "hisparse": ["memory.system=hisparse", "memory.hisparse.device_buffer_size=8",
                 "memory.hisparse.host_to_device_ratio=32"],
    "far_tier": ["memory.system=far_tier"],
}
STOP_AT = 3  # steps run before SIGTERM
EVERY = 2  # engine.checkpoint_every


def _cfg(system: str, *extra: str):
  return load_config(QUICKSTART, COMMON + SYSTEMS[system] + list(extra))


def _mesh() -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.asarray(jax.devices()[:2]).reshape(2, 1), ("dp", "tp"))


def _tokens(requests) -> dict:
  return {r.id: list(r.output_tokens) for r in requests}


def _summary(run_dir: Path) -> dict:
  return json.loads((Path(run_dir) / "summary.json").read_text())


def _sigterm_after(monkeypatch, steps: int) -> None:
  """The next run gets SIGTERM once it has written ``steps`` metrics lines (the signal
  handler of the run notes it; the engine stops at the end of that step)."""

  class Writer(MetricsWriter):
    def write(self, m) -> None:
      super().write(m)
      if m.step == steps - 1:
        signal.raise_signal(signal.SIGTERM)

  monkeypatch.setattr(ula_jax.run, "MetricsWriter", Writer)


def _interrupted_run(monkeypatch, cfg, out: Path) -> Path:
  _sigterm_after(monkeypatch, STOP_AT)
  with pytest.raises(RunInterrupted) as e:
    run_experiment(cfg, out, progress=False, show=False)
  monkeypatch.undo()
  assert e.value.signal_name == "SIGTERM" and e.value.run_dir == out
  assert _summary(out)["status"] == "interrupted"
  return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
  """Each system's run left alone: (tokens, summary with the step metrics), computed once."""
  out = {}

  def get(system: str):
    if system not in out:
      result, _ = run_experiment(_cfg(system), tmp_path_factory.mktemp(system) / "run",
                                 progress=False, show=False)
      assert [r.status for r in result.requests] == ["finished"] * 4
      out[system] = (_tokens(result.requests),
                     {**result.summary, "_steps": [m.as_dict() for m in result.steps]})
    return out[system]

  return get


# ----------------------------------------------------------------------------------
# Resumed runs decode the uninterrupted run's tokens
# ----------------------------------------------------------------------------------


def test_restored_ula_engine_continues_token_for_token(tmp_path, monkeypatch, references):
  cfg = _cfg("ula", f"engine.checkpoint_every={EVERY}")
  run_dir = _interrupted_run(monkeypatch, cfg, tmp_path / "run")
  # The latest checkpoint only: the one taken at the signal, not the one of step 2.
  assert [p.name for p in (run_dir / "checkpoint").iterdir()] == [f"step-{STOP_AT:08d}"]
  doc = checkpoint.read_host(run_dir / "checkpoint" / f"step-{STOP_AT:08d}")
  prompt_len = {r["id"]: r["prompt_len"] for r in doc["requests"]}
  assert doc["queue"] and all(0 < l["prefilled"] < prompt_len[l["id"]]
                              for rank in doc["rows"] for l in rank)

  engine = Engine(cfg, _mesh())
  requests = build_requests(cfg)
  latest = checkpoint.latest(run_dir / "checkpoint")
  with pytest.raises(checkpoint.CheckpointError, match=r"the workload's requests differ "
                     r"from the checkpointed run's: request 'req-0000': prompt_len"):
    checkpoint.restore(engine, latest, build_requests(_cfg("ula", "workload.seed=1")))
  state = checkpoint.restore(engine, latest, requests)
  assert state.step == STOP_AT and len(state.steps) == STOP_AT
  result = engine.run(requests, resume=state)

  ref_tokens, ref_summary = references("ula")
  assert [r.status for r in result.requests] == ["finished"] * 4
  assert _tokens(result.requests) == ref_tokens
  assert result.summary["resumed_at_steps"] == [STOP_AT]
  # The cumulative metrics go on from the checkpoint's; entries really moved.
  for key in ("steps", "generated_tokens", "total_hits", "total_misses", "total_evictions"):
    assert result.summary[key] == ref_summary[key], key
  assert ref_summary["total_misses"] > 0 and ref_summary["total_evictions"] > 0
  assert [m.device_used for m in result.steps] == [m["device_used"] for m in ref_summary[
      "_steps"]]


@pytest.mark.parametrize("system,stored,pack", [
    *[(s, stored, False) for s in sorted(SYSTEMS)
      for stored in ("default", "all_files", "all_orbax")],
    ("ula", "default", True)])
def test_every_systems_state_round_trips_bit_for_bit(system, stored, pack, tmp_path, seed,
                                                     monkeypatch):
  """Every leaf of the memory system's state and the prefill workspace (random values)
  comes back bit for bit, in its sharding and memory kind (pinned_host pools too),
  whether written as shard files (host pools always; ``all_files``: device leaves too,
  made anew on restore) or through orbax (``all_orbax``: as format 1 wrote every leaf);
  with ``engine.pack_state`` too, whose steps' carry holds the pools beside packed
  copies of the small leaves."""
  if stored == "all_files":
    monkeypatch.setattr(checkpoint, "STREAMED_BYTES", 0)
  elif stored == "all_orbax":
    monkeypatch.setattr(checkpoint, "_streamed", lambda x: False)
  cfg = _cfg(system, f"engine.pack_state={str(pack).lower()}")
  rng = np.random.default_rng(seed)

  def random_like(x):
    if x.dtype == bool:
      value = rng.integers(0, 2, x.shape).astype(bool)
    elif np.issubdtype(x.dtype, np.integer):
      value = rng.integers(-5, 1000, x.shape).astype(x.dtype)
    else:
      value = rng.standard_normal(x.shape).astype(x.dtype)
    return jax.device_put(value, x.sharding)

  saved = Engine(cfg, _mesh())
  saved.state = jax.tree.map(random_like, saved.state)
  saved.workspace = jax.tree.map(random_like, saved.workspace)
  requests = build_requests(cfg)
  saved.run_state = RunState.start(requests, 2, 1, saved.mem.num_logical // 16)
  path = checkpoint.save(saved, tmp_path / "checkpoint")
  files = checkpoint.read_host(path)["pool_files"]
  kinds = [x.sharding.memory_kind for x in jax.tree.leaves((saved.state, saved.workspace))]
  assert len(files) == {"default": kinds.count("pinned_host"), "all_files": len(kinds),
                        "all_orbax": 0}[stored]

  restored = Engine(cfg, _mesh())
  checkpoint.restore(restored, path, requests)
  a = jax.tree.leaves((saved.state, saved.workspace))
  b = jax.tree.leaves((restored.state, restored.workspace))
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.sharding == y.sharding  # the memory kind too
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  kinds = {x.sharding.memory_kind for x in b}
  assert kinds == ({"device"} if system == "resident" else {"device", "pinned_host"})


def test_host_pools_are_restored_in_place(tmp_path, monkeypatch):
  """A host pool written as shard files is read back into the live pool's own bytes:
  the restore pins no second pool, and no region is given back for it."""
  from ula_jax.core import pinned_region

  cfg = _cfg("ula")
  saved = Engine(cfg, _mesh())
  saved.state = jax.tree.map(lambda x: x + 1 if x.dtype != bool else x, saved.state)
  requests = build_requests(cfg)
  saved.run_state = RunState.start(requests, 2, 1, saved.mem.num_logical // 16)
  path = checkpoint.save(saved, tmp_path / "checkpoint")
  restored = Engine(cfg, _mesh())
  pools = [x for x in jax.tree.leaves(restored.state) if x.sharding.memory_kind == "pinned_host"]
  before = [s.data.unsafe_buffer_pointer() for x in pools for s in x.addressable_shards]
  freed = []
  monkeypatch.setattr(pinned_region, "release_unused",
                      lambda *a: freed.append(any(x.is_deleted() for x in pools)) or 0)
  checkpoint.restore(restored, path, requests)
  after = [x for x in jax.tree.leaves(restored.state) if x.sharding.memory_kind == "pinned_host"]
  assert pools and all(x is y for x, y in zip(pools, after)) and freed == [False]
  assert [s.data.unsafe_buffer_pointer() for x in after for s in x.addressable_shards] == before
  for x, y in zip(jax.tree.leaves(saved.state), jax.tree.leaves(restored.state)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_broken_pool_files_are_refused_before_anything_is_deleted(tmp_path):
  cfg = _cfg("ula")
  saved = Engine(cfg, _mesh())
  requests = build_requests(cfg)
  saved.run_state = RunState.start(requests, 2, 1, saved.mem.num_logical // 16)
  path = checkpoint.save(saved, tmp_path / "checkpoint")
  shard = next((path / checkpoint.POOLS_DIR).glob("*/shard-00001.bin"))
  with open(shard, "r+b") as f:
    f.truncate(shard.stat().st_size - 1)
  restored = Engine(cfg, _mesh())
  with pytest.raises(checkpoint.CheckpointError, match=rf"{shard}: \d+ bytes \(description: "
                     r"\d+\), the shard at index \[\[1, 2\]"):
    checkpoint.restore(restored, path, requests)
  assert not any(x.is_deleted() for x in jax.tree.leaves((restored.state, restored.workspace)))
  shard.unlink()
  with pytest.raises(checkpoint.CheckpointError, match=rf"{shard}: unreadable"):
    checkpoint.restore(restored, path, requests)


def test_sigterm_then_resume_from_the_command_line(tmp_path, monkeypatch, capsys,
                                                   references):
  out = tmp_path / "run"
  argv = ["run", QUICKSTART, *COMMON, f"engine.checkpoint_every={EVERY}", "--no-progress",
          "--out", str(out)]
  _sigterm_after(monkeypatch, STOP_AT)
  assert main(argv) == 143
  monkeypatch.undo()
  err = capsys.readouterr().err
  assert "Traceback" not in err and f"interrupted (SIGTERM); run directory written: {out}" in err
  doc = _summary(out)
  assert doc["status"] == "interrupted" and doc["stats"]["steps"] == STOP_AT
  assert any(r["status"] == "interrupted" for r in doc["requests"])

  # Refused, and the run directory left as it was: a CONFIG, --out, a changed model.
  before = sorted(p.name for p in out.iterdir())
  for args, match in [
      ([QUICKSTART], r"give no CONFIG"),
      (["--out", str(tmp_path / "x")], r"--out and --overwrite do not apply"),
      (["model.num_layers=6", "memory.system=ula"],
       r"memory.system='ula', but the checkpointed run has memory.system='resident'.*"
       r"model.num_layers=6, but the checkpointed run has model.num_layers=\d"),
  ]:
    assert main(["run", "--resume", str(out), *args]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert re.search(match, err, re.S), err
  assert sorted(p.name for p in out.iterdir()) == before

  # Resumed with a free override, now decoding; SIGTERM again three steps later.
  _sigterm_after(monkeypatch, STOP_AT + 3)
  assert main(["run", "--resume", str(out), "engine.checkpoint_every=100",
               "--no-progress"]) == 143
  monkeypatch.undo()
  assert _summary(out)["stats"]["steps"] == STOP_AT + 3
  assert [p.name for p in (out / "checkpoint").iterdir()] == [f"step-{STOP_AT + 3:08d}"]
  # Then killed outright (SIGKILL, power loss) while resumed again: no run directory,
  # its hidden partial folder with the last checkpoint, its process gone. --resume DIR
  # finds the folder and runs to the end.
  (out / "summary.json").unlink()
  dead = 2**22 + 12345  # above the default pid_max
  os.rename(out, tmp_path / f".run.partial-{dead}")
  assert main(["run", "--resume", str(out), "--no-progress"]) == 0
  assert f"run directory: {out}" in capsys.readouterr().out

  ref_tokens, ref_summary = references("resident")
  doc = _summary(out)
  assert doc["status"] == "finished"
  assert {r["id"]: r["output_tokens"] for r in doc["requests"]} == ref_tokens
  assert doc["summary"]["resumed_at_steps"] == [STOP_AT, STOP_AT + 3]
  metrics = (out / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(m)["step"] for m in metrics] == list(range(ref_summary["steps"]))
  assert load_config(out / "config.yaml").engine.checkpoint_every == 100  # (kept)
  # A finished run keeps no checkpoint, and nothing is left beside it.
  assert not (out / "checkpoint").exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


# ----------------------------------------------------------------------------------
# Refusals (nothing runs)
# ----------------------------------------------------------------------------------


def _fake_run(path: Path, status: str, *overrides: str) -> Path:
  path.mkdir()
  (path / "config.yaml").write_text(config_to_yaml(load_config(QUICKSTART, list(overrides))))
  (path / "summary.json").write_text(json.dumps({"status": status, "requests": []}))
  return path


@pytest.mark.parametrize("case", ["missing", "file", "finished", "no-checkpoint",
                                  "checkpoint-off", "not-a-run", "locked", "live-writer"])
def test_resume_refusals_exit_2_with_a_message(tmp_path, capsys, case):
  target = tmp_path / "run"
  if case == "missing":
    match = r"no such run directory"
  elif case == "file":
    target.write_text("")
    match = r"is not a directory"
  elif case == "finished":
    _fake_run(target, "finished", "engine.checkpoint_every=4")
    match = r"the run finished \(summary.json: status 'finished'\); there is nothing to resume"
  elif case == "no-checkpoint":
    _fake_run(target, "interrupted", "engine.checkpoint_every=4")
    match = r"no checkpoint to resume from .*the run stopped before it wrote one"
  elif case == "checkpoint-off":
    _fake_run(target, "interrupted")
    match = (r"no checkpoint to resume from .*engine.checkpoint_every=0; with "
             r"engine.checkpoint_every=N > 0 a run writes one every N steps")
  elif case == "not-a-run":
    target.mkdir()
    (target / "notes.txt").write_text("")
    match = r"not a run directory \(no config.yaml\)"
  elif case == "locked":
    _fake_run(target, "interrupted", "engine.checkpoint_every=4")
    (target / "checkpoint" / "step-00000002").mkdir(parents=True)
    (target / "checkpoint" / "step-00000002" / "engine.json").write_text("{}")
    lock = DirLock(target)
    assert lock.acquire()
    match = r"another run \(pid \d+\) is writing it"
  else:  # a run in progress without --out: its partial folder, its process alive
    partial = tmp_path / f".run.partial-{os.getppid()}-abcd1234"
    _fake_run(partial, "interrupted", "engine.checkpoint_every=4")
    match = rf"a run \(pid {os.getppid()}\) is still writing it"
  assert main(["run", "--resume", str(target), "--no-progress"]) == EXIT_USAGE
  err = capsys.readouterr().err
  assert err.startswith(f"error: --resume {target}") and "Traceback" not in err
  assert re.search(match, err), err
  if case == "locked":
    lock.release()


def test_run_needs_a_config_or_resume_and_launch_refuses_resume(capsys):
  with pytest.raises(SystemExit) as e:
    main(["run"])
  assert e.value.code == EXIT_USAGE
  assert "required: config (or --resume DIR)" in capsys.readouterr().err
  assert main(["launch", "--processes", "2", "run", "--resume", "x"]) == EXIT_USAGE
  assert "only single-process runs write checkpoints" in capsys.readouterr().err


def test_checkpoint_every_is_validated():
  with pytest.raises(ValueError, match=r"engine.checkpoint_every=-1: must be >= 0"):
    load_config(QUICKSTART, ["engine.checkpoint_every=-1"])
  with pytest.raises(ValueError, match=r"engine.checkpoint_every=2 cannot be combined with "
                     r"engine.record_trace=true"):
    load_config(QUICKSTART, ["engine.checkpoint_every=2", "engine.record_trace=true"])
  assert load_config(QUICKSTART).engine.checkpoint_every == 0


def test_checkpoint_records_the_workload_it_belongs_to():
  cfg = load_config(QUICKSTART, COMMON)
  requests = build_requests(cfg)
  doc = {"requests": [checkpoint.request_digest(r) for r in requests]}
  assert checkpoint.request_changes(doc, requests) == []
  other = build_requests(load_config(QUICKSTART, COMMON + ["workload.seed=1"]))
  changes = checkpoint.request_changes(doc, other)
  assert len(changes) == 3  # the first three
  assert re.match(r"request 'req-0000': prompt_len \d+ \(was \d+\), prompt_sha1 '\w+' "
                  r"\(was '\w+'\)", changes[0]), changes
  assert checkpoint.request_changes(doc, requests[:3]) == [
      "3 requests, but the checkpointed run has 4"]
  assert checkpoint.config_changes(cfg.model_dump(mode="json"), load_config(
      QUICKSTART, COMMON + ["engine.max_steps=5", "engine.checkpoint_every=3"])) == []


def test_latest_checkpoint_ignores_unfinished_writes(tmp_path):
  root = tmp_path / "checkpoint"
  assert checkpoint.latest(root) is None
  for name in ("step-00000004", "step-00000010", ".tmp-step-00000012-7", "step-00000011"):
    (root / name).mkdir(parents=True)
  for name in ("step-00000004", "step-00000010", ".tmp-step-00000012-7"):
    (root / name / "engine.json").write_text("{}")
  # step 11 has no engine.json (not written by save), the .tmp folder is not renamed yet
  assert checkpoint.latest(root) == root / "step-00000010"
  with pytest.raises(checkpoint.CheckpointError, match=r"engine.json: format=None, this "
                     r"version reads format 1 or 2"):
    checkpoint.read_host(root / "step-00000010")
  with pytest.raises(checkpoint.CheckpointError, match=r"engine.json: missing"):
    checkpoint.read_host(root / "step-00000011")
