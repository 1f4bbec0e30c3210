"""The ``ula-jax`` command line: config, compare, sweep planning and error paths."""

from __future__ import annotations

import csv
import json
import logging
import re
from pathlib import Path

import pytest
import yaml

from ula_jax.cli.main import (EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, VERBS, build_parser, parse_args,
                         combination_dirname, configure_logging, main, split_values,
                         sweep_plan)
from ula_jax.config import ConfigError, load_config
from ula_jax.config.loader import REPO_CONFIGS
from ula_jax.engine.types import RequestResult, RunResult
from ula_jax.report import read_metrics, read_summary, write_outputs
from ula_jax.report.stats import prompt_sha1
from ula_jax.workloads import build_requests

QUICKSTART = str(REPO_CONFIGS.parent / "experiments" / "quickstart" / "config.yaml")


def test_config_prints_the_resolved_config(capsys):
  assert main(["config", QUICKSTART, "engine.max_batch=3", "memory=ula_lru"]) == EXIT_OK
  doc = yaml.safe_load(capsys.readouterr().out)
  assert doc["engine"]["max_batch"] == 3
  assert doc["memory"]["system"] == "ula" and doc["memory"]["policy"] == "lru"
  assert doc["engine"]["max_context"] == load_config(QUICKSTART).engine.max_context


@pytest.mark.parametrize("args,match", [
    (["config", QUICKSTART, "memory.polcy=lru"],
     r"unknown field 'memory.polcy' \(did you mean 'policy'\?\)"),
    (["config", QUICKSTART, "mesh.tp=0", "memory.policy=fifo"],
     r"2 problems\n  - memory.policy='fifo'.*\n  - mesh.tp=0: must be >= 1"),
    (["config", QUICKSTART, "mesh.tp=3"], r"mesh.tp=3 does not divide model.num_heads=4"),
    (["config", "experiments/nope/config.yaml"], r"config file not found"),
    (["config", QUICKSTART, "engine.max_batch"], r"expected key=value"),
    (["compare", "/nonexistent/a", "/nonexistent/b"], r"not a run directory"),
    (["sweep", QUICKSTART, "engine.max_batch=2"], r"sweep: no key has a list of values"),
    (["sweep", QUICKSTART, "engine.max_batch=1,2", "engine.max_batch=3,4"],
     r"sweep: engine.max_batch is swept twice"),
    (["sweep", QUICKSTART, "engine.max_batch=1,,2"], r"has an empty value in its list"),
    (["sweep", QUICKSTART, "engine.max_batch=1,0"], r"engine.max_batch=0: must be >= 1"),
    (["sweep", QUICKSTART, "workload.kind=file", "workload.path=/nonexistent/r.jsonl",
      "engine.max_batch=1,2"], r"workload.path='/nonexistent/r.jsonl': no such file"),
])
def test_errors_exit_2_with_a_message(capsys, args, match):
  assert main(args) == EXIT_USAGE
  err = capsys.readouterr().err
  assert err.startswith("error: ")
  assert re.search(match, err), err


def test_unknown_verb_and_missing_arguments_are_usage_errors(capsys):
  with pytest.raises(SystemExit) as e:
    main(["frobnicate"])
  assert e.value.code == 2
  assert "invalid choice: 'frobnicate'" in capsys.readouterr().err
  with pytest.raises(SystemExit) as e:
    main(["run"])
  assert e.value.code == 2
  assert "the following arguments are required: config" in capsys.readouterr().err


def test_log_level_adds_timed_lines_to_the_package_logger(capsys):
  assert parse_args(["config", "experiments/quickstart/config.yaml"]).log_level == "warning"
  args = parse_args(["--log-level", "info", "config", "experiments/quickstart/config.yaml"])
  assert args.log_level == "info"
  with pytest.raises(SystemExit):
    parse_args(["--log-level", "loud", "config", "experiments/quickstart/config.yaml"])
  assert "invalid choice: 'loud'" in capsys.readouterr().err
  log = logging.getLogger("ula_jax")
  before = (list(log.handlers), log.level)
  try:
    configure_logging("warning")  # the default leaves the package's logger alone
    assert (list(log.handlers), log.level) == before
    configure_logging("info")
    configure_logging("info")  # a second call adds no second handler
    logging.getLogger("ula_jax.bench.serving").info("ula_dp: capacity 29 requests")
    err = capsys.readouterr().err
    assert re.search(r"^\d\d:\d\d:\d\d ula_dp: capacity 29 requests$", err, re.M)
    assert err.count("capacity 29 requests") == 1
  finally:
    log.handlers[:], log.level = before[0], before[1]


def test_every_verb_is_in_the_parser():
  help_text = build_parser().format_help()
  for name in ("run", "sweep", "config", "compare", "bench"):
    assert name in VERBS and name in help_text


def test_bench_hands_its_arguments_to_the_benchmark(capsys):
  with pytest.raises(SystemExit) as e:
    main(["bench", "fetch", "--help"])
  assert e.value.code == 0
  assert "usage: ula-jax bench fetch" in capsys.readouterr().out
  with pytest.raises(SystemExit) as e:
    main(["bench", "nope"])
  assert e.value.code == 2
  assert "invalid choice: 'nope'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------
# sweep planning
# ----------------------------------------------------------------------------------


def test_split_values_respects_brackets_and_quotes():
  assert split_values("1,2,3") == ["1", "2", "3"]
  assert split_values("[1,2],[3,4]") == ["[1,2]", "[3,4]"]
  assert split_values("'a,b',c") == ["'a,b'", "c"]
  assert split_values("{x: 1, y: 2}") == ["{x: 1, y: 2}"]
  assert split_values("8GiB") == ["8GiB"]


def test_sweep_plan_separates_swept_and_fixed():
  swept, fixed = sweep_plan(["memory=resident,ula_pb_lru", "engine.max_batch=1,2",
                             "workload.num_requests=4", "workload.prompt_len=[10,20]"])
  assert swept == {"memory": ["resident", "ula_pb_lru"], "engine.max_batch": ["1", "2"]}
  assert fixed == ["workload.num_requests=4", "workload.prompt_len=[10,20]"]


def test_combination_dirname_is_a_safe_name():
  assert combination_dirname(3, {"memory.system": "ula", "engine.max_batch": "4"}) == \
      "003-system=ula-max_batch=4"
  assert combination_dirname(0, {"workload.prompt_len": "[10, 20]"}) == "000-prompt_len=_10_20_"


def test_sweep_plan_error_without_lists():
  with pytest.raises(ConfigError, match=r"give at least one key=v1,v2"):
    sweep_plan(["a.b=1"])


# ----------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------


def run_dir(tmp_path, name: str, tokens: list[list[int]], model: dict | None = None):
  path = tmp_path / name
  path.mkdir()
  reqs = [RequestResult(f"r{i}", 5, len(t), "finished", t) for i, t in enumerate(tokens)]
  write_outputs(path, RunResult(steps=[], requests=reqs, capacity={}, summary={}), plots=False,
                prompts={f"r{i}": [i] * 5 for i in range(len(tokens))})
  (path / "config.yaml").write_text(yaml.safe_dump({"model": model or {"preset": "tiny"}}))
  return str(path)


def test_compare_matching_runs_exits_0(tmp_path, capsys):
  a = run_dir(tmp_path, "a", [[1, 2, 3], [4]])
  b = run_dir(tmp_path, "b", [[1, 2, 3], [4]])
  assert main(["compare", a, b]) == EXIT_OK
  out = capsys.readouterr().out
  assert "all 2 requests match token by token (4 tokens compared)" in out
  assert "note:" not in out  # both recorded prompt hashes


def test_compare_mismatch_exits_1(tmp_path, capsys):
  a = run_dir(tmp_path, "a", [[1, 2, 3], [4]])
  b = run_dir(tmp_path, "b", [[1, 9, 3], [4]])
  assert main(["compare", a, b]) == EXIT_MISMATCH
  out = capsys.readouterr().out
  assert "r0: tokens differ from index 1" in out and "1 of 2 requests differ" in out


@pytest.mark.parametrize("b_tokens,b_model,match", [
    ([[1, 2, 3]], None, r"ran different workloads; .*\n  - 1 request\(s\) only in A: r1"),
    ([[1, 2], [4]], None, r"request r0: max_new_tokens 3 in A, 2 in B"),
    ([[1, 2, 3], [4]], {"preset": "small"},
     r"ran different models; .*\n  - model.preset: 'tiny' in A, 'small' in B"),
    ([[], []], None, r"no token to compare"),
])
def test_compare_of_incomparable_runs_exits_2(tmp_path, capsys, b_tokens, b_model, match):
  a = run_dir(tmp_path, "a", [[1, 2, 3], [4]] if b_tokens != [[], []] else [[], []])
  b = run_dir(tmp_path, "b", b_tokens, model=b_model)
  assert main(["compare", a, b]) == EXIT_USAGE
  captured = capsys.readouterr()
  assert captured.err.startswith("error: compare: ") and "Traceback" not in captured.err
  assert re.search(match, captured.err), captured.err
  assert "match token by token" not in captured.out


def test_compare_of_a_malformed_run_exits_2_naming_file_and_field(tmp_path, capsys):
  a = run_dir(tmp_path, "a", [[1, 2, 3], [4]])
  b = run_dir(tmp_path, "b", [[1, 2, 3], [4]])
  doc = json.loads((Path(b) / "summary.json").read_text())
  del doc["requests"][0]["max_new_tokens"]
  (Path(b) / "summary.json").write_text(json.dumps(doc))
  assert main(["compare", a, b]) == EXIT_USAGE
  err = capsys.readouterr().err
  assert err == f"error: {b}/summary.json: requests[0] has no 'max_new_tokens' field\n"


# ----------------------------------------------------------------------------------
# end to end (the engine on 8 simulated CPU devices)
# ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_writes_a_complete_run_directory_and_reruns_identically(tmp_path, capsys):
  # Dense MLPs in every layer: what a run directory holds does not depend on the kind of
  # MLP, whose MoE code is about a quarter of each step's compile time.
  overrides = ["workload.num_requests=8", "engine.max_batch=1", "model.num_dense_layers=4"]
  first, second = tmp_path / "first", tmp_path / "second"
  assert main(["run", QUICKSTART, *overrides, "--out", str(first), "--no-progress"]) == EXIT_OK
  out = capsys.readouterr().out
  assert "tokens generated" in out and f"run directory: {first}" in out
  for name in ("config.yaml", "metrics.jsonl", "summary.json", "requests.jsonl", "run.png"):
    assert (first / name).is_file(), name
  assert load_config(first / "config.yaml") == load_config(QUICKSTART, overrides)

  summary = read_summary(first)
  assert summary["status"] == "finished"
  cfg = load_config(QUICKSTART, overrides)
  expected = {r.id: r for r in build_requests(cfg)}
  assert [r["id"] for r in summary["requests"]] == list(expected)
  for r in summary["requests"]:
    assert r["status"] == "finished" and r["reason"] is None
    assert r["prompt_len"] == expected[r["id"]].prompt_len
    assert r["prompt_sha1"] == prompt_sha1(expected[r["id"]].prompt)
    assert len(r["output_tokens"]) == expected[r["id"]].max_new_tokens
  assert summary["stats"]["finished"] == 8
  assert summary["stats"]["tokens_generated"] == sum(q.max_new_tokens for q in expected.values())
  metrics = read_metrics(first / "metrics.jsonl")
  assert len(metrics) == summary["stats"]["steps"] and metrics[-1]["finished"] == 8
  assert max(m["running"] for m in metrics) <= cfg.mesh.dp * cfg.engine.max_batch

  # The rerun replaces an older run's directory (--overwrite).
  second.mkdir()
  (second / "summary.json").write_text("{}")
  (second / "stale.txt").write_text("")
  assert main(["run", str(first / "config.yaml"), "--out", str(second), "--no-progress"]) == 2
  assert "exists and is not empty; give --overwrite" in capsys.readouterr().err
  assert main(["run", str(first / "config.yaml"), "--out", str(second), "--no-progress",
               "--overwrite"]) == 0
  capsys.readouterr()
  assert not (second / "stale.txt").exists() and (second / "metrics.jsonl").is_file()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "second"]
  assert main(["compare", str(first), str(second)]) == EXIT_OK
  assert "all 8 requests match token by token" in capsys.readouterr().out


@pytest.mark.slow
def test_sweep_runs_every_combination_into_one_table(tmp_path, capsys):
  out = tmp_path / "sweep"
  assert main(["sweep", QUICKSTART, "workload.seed=0,1", "workload.num_requests=4",
               "model.num_dense_layers=4", "--out", str(out), "--no-progress"]) == EXIT_OK
  text = capsys.readouterr().out
  assert "sweep of quickstart" in text and f"sweep directory: {out}" in text
  doc = json.loads((out / "sweep.json").read_text())
  assert doc["swept"] == {"workload.seed": ["0", "1"]}
  assert doc["fixed"] == ["workload.num_requests=4", "model.num_dense_layers=4"]
  assert [row["workload.seed"] for row in doc["rows"]] == [0, 1]
  for row in doc["rows"]:
    assert row["finished"] == 4 and row["rejected"] == 0
    assert (Path(row["run_dir"]) / "summary.json").is_file()
  with (out / "sweep.csv").open() as f:
    rows = list(csv.DictReader(f))
  assert [r["workload.seed"] for r in rows] == ["0", "1"]
  assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
  # Different seeds serve different prompts.
  a, b = (read_summary(row["run_dir"]) for row in doc["rows"])
  assert [r["prompt_len"] for r in a["requests"]] != [r["prompt_len"] for r in b["requests"]]


def test_sizes_the_memory_system_rejects_fail_before_the_run_directory_exists(tmp_path, capsys):
  out = tmp_path / "run"
  assert main(["run", QUICKSTART, "memory.device_pool=10", "--out", str(out)]) == EXIT_USAGE
  assert re.search(r"memory.device_pool holds 0 tokens per device, fewer than one page",
                   capsys.readouterr().err)
  assert not out.exists()


def test_overrides_may_follow_options():
  args = parse_args(["run", QUICKSTART, "--no-progress", "engine.max_batch=3", "--out", "x",
                     "memory=ula_lru"])
  assert args.overrides == ["engine.max_batch=3", "memory=ula_lru"]
  assert args.no_progress and args.out == "x"
  args = parse_args(["sweep", QUICKSTART, "--no-progress", "memory.system=resident,ula"])
  assert args.items == ["memory.system=resident,ula"]
  with pytest.raises(SystemExit):
    parse_args(["run", QUICKSTART, "--no-progress", "--bogus"])
