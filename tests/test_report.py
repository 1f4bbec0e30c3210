"""Run statistics, the run directory's files, tables, plots and comparisons (hand-made
results; no engine)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from ula_jax.engine.types import RequestResult, RunResult, StepMetrics
from ula_jax.report import (METRICS_FILE, REQUESTS_FILE, RUN_PLOT, SUMMARY_FILE,
                            MetricsWriter, RunDirError, RunProgress, aggregate_extra,
                            compare_runs, compare_table, new_run_dir, read_metrics,
                            read_summary, run_stats, summary_table, sweep_table,
                            write_outputs)
from ula_jax.report.compare import IncomparableRuns
from ula_jax.report.plots import plot_sweep
from ula_jax.report.stats import prompt_sha1
from ula_jax.report.tables import fmt

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step(i: int, running: int, decode_tokens: int, decode_time: float, device: int,
         host: int = 0, finished: int = 0, **extra) -> StepMetrics:
  return StepMetrics(step=i, kind="decode", running=running, prefilling=0, waiting=0,
                     finished=finished, decode_tokens=decode_tokens, prefill_tokens=0,
                     step_time_s=decode_time + 0.5, decode_time_s=decode_time,
                     tokens_per_s=decode_tokens / decode_time if decode_time else 0.0,
                     device_used=device, host_used=host, distinct=device, extra=extra)


def hand_made_result(tokens_b=(7, 8, 9)) -> RunResult:
  steps = [
      step(0, 2, 2, 0.5, device=100, host=10, hits=3, misses=1, mean_bucket=1.0),
      step(1, 3, 3, 1.0, device=160, host=30, finished=1, hits=5, misses=3, mean_bucket=3.0),
      step(2, 1, 1, 0.5, device=40, host=5, finished=2, hits=0, misses=0, mean_bucket=2.0),
  ]
  requests = [
      RequestResult("a", 10, 2, "finished", [1, 2], ttft_s=0.2, decode_time_s=1.0),
      RequestResult("b", 12, 3, "finished", list(tokens_b), ttft_s=0.4, decode_time_s=1.5),
      RequestResult("c", 999, 4, "rejected", [], reason="needs 1024 KV tokens"),
  ]
  capacity = {"system": "ula", "device_capacity": [[200], [200]], "host_capacity": [[50], [50]],
              "distinct_fraction": 0.75}
  return RunResult(steps=steps, requests=requests, capacity=capacity,
                   summary={"wall_time_s": 4.0, "memory_system": "ula"})


def test_run_stats_by_hand():
  s = run_stats(hand_made_result())
  assert (s["requests"], s["finished"], s["rejected"]) == (3, 2, 1)
  assert s["tokens_generated"] == 5
  assert s["wall_time_s"] == 4.0 and s["tokens_per_s"] == 5 / 4.0
  assert s["decode_tokens_per_s"] == 6 / 2.0
  assert (s["peak_batch"], s["peak_device_used"], s["peak_host_used"]) == (3, 160, 30)
  assert (s["device_capacity"], s["host_capacity"]) == (400, 100)
  assert s["distinct_fraction"] == 0.75
  assert s["mean_ttft_s"] == pytest.approx(0.3)
  assert s["mean_tpot_s"] == pytest.approx((1.0 / 2 + 1.5 / 3) / 2)
  assert s["steps"] == 3
  assert (s["hits"], s["misses"], s["hit_rate"]) == (8, 4, 8 / 12)
  assert s["mean_bucket"] == 2.0


def test_run_stats_without_engine_wall_time_sums_steps():
  r = hand_made_result()
  r.summary = {}
  assert run_stats(r)["wall_time_s"] == pytest.approx(2.0 + 3 * 0.5)


def test_run_stats_of_an_empty_run():
  s = run_stats(RunResult(steps=[], requests=[], capacity={}, summary={}))
  assert s["tokens_per_s"] == 0.0 and s["peak_batch"] == 0 and s["device_capacity"] is None
  assert s["mean_ttft_s"] is None


def test_aggregate_extra_skips_non_numbers_and_keeps_a_given_hit_rate():
  steps = [step(0, 1, 1, 1.0, 1, note="x", flag=True, hit_rate=0.5),
           step(1, 1, 1, 1.0, 1, hit_rate=0.7)]
  assert aggregate_extra(steps) == {"hit_rate": pytest.approx(0.6)}
  assert aggregate_extra([step(0, 1, 1, 1.0, 1, hits=0, misses=0)])["hit_rate"] == 1.0


def test_metrics_writer_streams_one_line_per_step(tmp_path):
  result = hand_made_result()
  path = tmp_path / METRICS_FILE
  with MetricsWriter(path) as w:
    w.write(result.steps[0])
    assert len(read_metrics(path)) == 1  # flushed as it goes
    w.write(result.steps[1])
  rows = read_metrics(path)
  assert rows == [m.as_dict() for m in result.steps[:2]]
  assert rows[1]["hits"] == 5  # extra flattened into the line


def test_write_outputs(tmp_path):
  import numpy as np

  result = hand_made_result()
  prompt = np.arange(12, dtype=np.int32)
  stats = write_outputs(tmp_path, result, name="exp", prompts={"b": prompt})
  doc = json.loads((tmp_path / SUMMARY_FILE).read_text())
  assert doc["experiment"] == "exp" and doc["status"] == "finished"
  assert "interrupted_by" not in doc
  assert doc["stats"] == json.loads(json.dumps(stats))
  assert doc["summary"] == result.summary and doc["capacity"] == result.capacity
  assert doc["requests"][1] == {"id": "b", "prompt_len": 12, "prompt_sha1": prompt_sha1(prompt),
                                "max_new_tokens": 3, "status": "finished", "reason": None,
                                "output_tokens": [7, 8, 9]}
  assert doc["requests"][0]["prompt_sha1"] is None  # no prompt given
  assert doc["requests"][2]["reason"] == "needs 1024 KV tokens"
  lines = (tmp_path / REQUESTS_FILE).read_text().splitlines()
  assert [json.loads(l) for l in lines] == [r.as_dict() for r in result.requests]
  assert (tmp_path / RUN_PLOT).read_bytes()[:8] == PNG_MAGIC


def test_write_outputs_without_plots(tmp_path):
  write_outputs(tmp_path, hand_made_result(), plots=False)
  assert not (tmp_path / RUN_PLOT).exists()
  assert (tmp_path / SUMMARY_FILE).is_file()


def test_numpy_values_are_written_as_json(tmp_path):
  import numpy as np

  result = hand_made_result()
  result.summary = {"wall_time_s": np.float64(2.0), "per_rank": np.arange(3)}
  write_outputs(tmp_path, result, plots=False)
  assert read_summary(tmp_path)["summary"] == {"wall_time_s": 2.0, "per_rank": [0, 1, 2]}


def test_prompt_sha1_depends_on_every_token_not_the_dtype():
  import numpy as np

  a = prompt_sha1(np.array([1, 2, 3], dtype=np.int32))
  assert a == prompt_sha1([1, 2, 3]) == prompt_sha1(np.array([1, 2, 3], dtype=np.int64))
  assert a != prompt_sha1([1, 2, 4]) and a != prompt_sha1([1, 2])
  assert len(a) == 40


def test_an_interrupted_run_says_so(tmp_path):
  result = hand_made_result()
  result.summary["interrupted_by"] = "SIGTERM"
  result.requests[1].status = "interrupted"
  write_outputs(tmp_path, result, plots=False)
  doc = read_summary(tmp_path)
  assert (doc["status"], doc["interrupted_by"]) == ("interrupted", "SIGTERM")
  assert [r["status"] for r in doc["requests"]] == ["finished", "interrupted", "rejected"]


def test_new_run_dir_never_reuses_a_directory(tmp_path):
  a = new_run_dir(tmp_path, "exp")
  b = new_run_dir(tmp_path, "exp")
  assert a != b and a.is_dir() and b.is_dir()
  assert a.name.startswith("exp-") and b.parent == tmp_path


def render(table) -> str:
  console = Console(file=io.StringIO(), width=200, record=True)
  console.print(table)
  return console.export_text()


def cells(text: str) -> list[list[str]]:
  """The body rows of a rendered table, as stripped cell strings."""
  return [[c.strip() for c in line.split("\u2502")[1:-1]]
          for line in text.splitlines() if line.startswith("\u2502")]


def test_summary_table_lists_totals_and_system_counters():
  table = dict(cells(render(summary_table(run_stats(hand_made_result()), title="exp"))))
  expected = {"finished": "2", "rejected": "1", "tokens generated": "5",
              "tokens/s (wall)": "1.25", "peak running batch": "3",
              "peak device slots used": "160", "device slots": "400",
              "peak host slots used": "30", "distinct fraction": "0.750",
              "wall time (s)": "4.00", "hits": "8", "misses": "4", "hit rate": "0.667"}
  assert {k: table.get(k) for k in expected} == expected


def test_sweep_table_has_one_row_per_combination():
  rows = [{"memory.system": s, "tokens_per_s": t, "finished": 4, "rejected": 0, "peak_batch": b,
           "peak_device_used": 10, "distinct_fraction": 1.0, "wall_time_s": 2.0}
          for s, t, b in [("resident", 100.0, 2), ("ula", 150.0, 3)]]
  text = render(sweep_table(rows, ["memory.system"]))
  assert "memory.system" in text and "tokens/s" in text
  assert cells(text) == [["resident", "100.0", "4", "0", "2", "10", "1.00", "2.00"],
                         ["ula", "150.0", "4", "0", "3", "10", "1.00", "2.00"]]


def test_fmt():
  assert [fmt(None), fmt(True), fmt(12345), fmt(0.5), fmt(0.0001), fmt(12.345), fmt(1234.5),
          fmt("x")] == ["-", "true", "12,345", "0.500", "0.0001", "12.35", "1,234.5", "x"]


def test_plot_sweep_writes_a_png(tmp_path):
  rows = [{"engine.max_batch": b, "tokens_per_s": 10.0 * b, "peak_batch": b} for b in (4, 1, 2)]
  path = plot_sweep(rows, "engine.max_batch", tmp_path / "sweep.png")
  assert path.read_bytes()[:8] == PNG_MAGIC


def test_progress_tracks_finished_requests():
  out = io.StringIO()
  with RunProgress(3, console=Console(file=out, width=120)) as bar:
    for m in hand_made_result().steps:
      bar.update(m)
  task = bar._progress.tasks[0]
  assert (task.completed, task.total) == (2, 3)
  assert "tok/s" in task.fields["status"]
  with RunProgress(3, enabled=False, console=Console(file=io.StringIO())) as quiet:
    quiet.update(hand_made_result().steps[0])


# ----------------------------------------------------------------------------------
# comparisons
# ----------------------------------------------------------------------------------


MODEL = {"preset": "tiny", "num_layers": 2, "num_heads": 4}


def write_run(path, result=None, model=None, prompts=None):
  """A run directory by hand: summary.json, requests.jsonl and config.yaml."""
  import yaml

  path.mkdir()
  write_outputs(path, result or hand_made_result(), plots=False, prompts=prompts)
  (path / "config.yaml").write_text(yaml.safe_dump({"model": model or MODEL}))
  return path


def test_compare_identical_runs(tmp_path):
  a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
  cmp = compare_runs(a, b)
  assert cmp.ok and [r["result"] for r in cmp.rows] == ["match"] * 3
  assert cmp.tokens_compared == 5
  assert len(cmp.notes) == 2 and "no prompt_sha1 recorded" in cmp.notes[0]


def test_compare_finds_every_kind_of_difference(tmp_path):
  a = write_run(tmp_path / "a")
  other = hand_made_result(tokens_b=(7, 0, 9))
  other.requests[0].status = "rejected"
  other.requests[2] = RequestResult("d", 1, 1, "finished", [5])
  b = write_run(tmp_path / "b", other)
  with pytest.raises(IncomparableRuns, match=r"1 request\(s\) only in A: c"):
    compare_runs(a, b)
  cmp = compare_runs(a, b, check=False)  # what the tokens say regardless
  assert not cmp.ok
  assert {r["id"]: r["result"] for r in cmp.rows} == {
      "a": "status differs", "b": "tokens differ from index 1", "c": "only in A",
      "d": "only in B"}
  assert len(cmp.mismatches) == 4
  text = render(compare_table(cmp.rows, "A vs B"))
  assert "tokens differ from index 1" in text


def test_compare_shorter_output_differs_at_its_end(tmp_path):
  a = write_run(tmp_path / "a")
  b = write_run(tmp_path / "b", hand_made_result(tokens_b=(7, 8)))
  rows = {r["id"]: r["result"] for r in compare_runs(a, b).rows}
  assert rows["b"] == "tokens differ from index 2"


def test_compare_refuses_different_workloads(tmp_path):
  import numpy as np

  prompts = {"a": np.arange(10), "b": np.arange(12), "c": np.arange(999)}
  a = write_run(tmp_path / "a", prompts=prompts)
  other = hand_made_result()
  other.requests[0].max_new_tokens = 5
  other.requests[1].prompt_len = 13
  b = write_run(tmp_path / "b", other, prompts={**prompts, "c": np.arange(1, 1000)})
  with pytest.raises(IncomparableRuns, match=r"ran different workloads") as e:
    compare_runs(a, b)
  assert str(e.value).splitlines()[1:] == [
      "  - request a: max_new_tokens 2 in A, 5 in B",
      "  - request b: prompt_len 12 in A, 13 in B",
      (f"  - request c: prompt_sha1 {prompt_sha1(np.arange(999))!r} in A, "
       f"{prompt_sha1(np.arange(1, 1000))!r} in B")]
  # Hashes recorded on both sides are compared; no note then.
  assert compare_runs(a, write_run(tmp_path / "c", prompts=prompts)).notes == []


def test_compare_refuses_different_models_listing_the_first_few(tmp_path):
  a = write_run(tmp_path / "a")
  b = write_run(tmp_path / "b", model={**MODEL, "num_layers": 4, "num_heads": 8,
                                       **{f"f{i}": i for i in range(6)}})
  with pytest.raises(IncomparableRuns, match=r"ran different models") as e:
    compare_runs(a, b)
  lines = str(e.value).splitlines()
  assert "(8 difference(s))" in lines[0]
  assert lines[1:3] == ["  - model.num_heads: 4 in A, 8 in B",
                        "  - model.num_layers: 2 in A, 4 in B"]
  assert lines[3] == "  - model.f0: '(not set)' in A, 0 in B"
  assert lines[-1] == "  - ... and 3 more"


def test_compare_refuses_runs_without_a_token_to_compare(tmp_path):
  empty = hand_made_result()
  for r in empty.requests:
    r.output_tokens = []
  a, b = write_run(tmp_path / "a", empty), write_run(tmp_path / "b")
  with pytest.raises(IncomparableRuns, match=r"no token to compare: .*a generated 0 "
                     r"token\(s\) and .*b 5 over 3 request\(s\)"):
    compare_runs(a, b)


@pytest.mark.parametrize("edit,match", [
    (lambda d: (d / "config.yaml").unlink(), r"config.yaml: missing"),
    (lambda d: (d / "config.yaml").write_text("model: [1\n"), r"config.yaml:\d+: not valid YAML"),
    (lambda d: (d / "config.yaml").write_text("engine: {}\n"),
     r"config.yaml: expected a mapping with a 'model' section"),
    (lambda d: _edit_request(d, lambda r: r.pop("output_tokens")),
     r"summary.json: requests\[1\] has no 'output_tokens' field"),
    (lambda d: _edit_request(d, lambda r: r.update(prompt_len="12")),
     r"summary.json: requests\[1\].prompt_len='12': expected int"),
    (lambda d: _edit_request(d, lambda r: r.update(output_tokens=[1, "x"])),
     r"requests\[1\].output_tokens: expected a list of integers"),
    (lambda d: _edit_request(d, lambda r: r.update(id="a")),
     r"requests\[1\].id='a' appears twice"),
    (lambda d: (d / SUMMARY_FILE).write_text("{"), r"summary.json:1: not valid JSON"),
])
def test_compare_names_the_file_and_field_of_a_malformed_run(tmp_path, edit, match):
  a, b = write_run(tmp_path / "a"), write_run(tmp_path / "b")
  edit(b)
  with pytest.raises(RunDirError, match=match):
    compare_runs(a, b)


def _edit_request(run_dir, change):
  doc = json.loads((run_dir / SUMMARY_FILE).read_text())
  change(doc["requests"][1])
  (run_dir / SUMMARY_FILE).write_text(json.dumps(doc))


def test_read_summary_errors(tmp_path):
  with pytest.raises(RunDirError, match=r"not a run directory \(no summary.json\)"):
    read_summary(tmp_path)
  (tmp_path / SUMMARY_FILE).write_text("{\n oops")
  with pytest.raises(RunDirError, match=r"summary.json:2: not valid JSON"):
    read_summary(tmp_path)
  (tmp_path / SUMMARY_FILE).write_text('{"requests": 3}')
  with pytest.raises(RunDirError, match=r"expected an object with a 'requests' list"):
    read_summary(tmp_path)
