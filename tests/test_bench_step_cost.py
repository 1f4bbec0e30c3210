"""``ula-jax bench step_cost``: an all-hit decode step of each memory system against
``resident``'s, on the same model, mesh and requests, one step or several per dispatch."""

from __future__ import annotations

import json

import pytest

from tests.engine_util import DENSE
from ula_jax.bench import step_cost

# Dense MLPs in every layer (``DENSE``): what is checked does not depend on the kind of
# MLP, whose MoE code is about a quarter of each step's compile time.
TINY = ["model=tiny", *DENSE, "mesh.platform=cpu", "mesh.dp=2"]


def test_all_hit_step_of_each_system_against_resident(tmp_path, capsys):
  # Three decode steps per dispatch: a step's time is a full dispatch's over three (one
  # step per dispatch, the default, is the same code with N = 1). Two rounds: every
  # engine kept, the systems timed in turn.
  per_dispatch, rounds = 3, 2
  out = tmp_path / "step_cost.json"
  rc = step_cost.main(["--systems", "resident,ula,hisparse", "--batch", "2", "--prompt", "40",
                       "--output", "16", "--json", str(out), "--rounds", str(rounds), *TINY,
                       f"engine.steps_per_dispatch={per_dispatch}"])
  assert rc == 0
  res = json.loads(out.read_text())
  assert res["batch_per_rank"] == 2 and res["dp"] == 2 and res["rounds"] == rounds
  systems = res["systems"]
  assert systems["resident"]["ratio_to_resident"] == 1.0
  assert systems["resident"]["round_ratios"] == [1.0] * rounds
  for name, row in systems.items():
    assert row["steps_per_dispatch"] == per_dispatch
    assert row["steps"] > 0 and row["steps"] % (per_dispatch * rounds) == 0, name
    assert row["median_step_s"] > 0 and row["tokens_equal_resident"] is True, name
    assert row["ratio_to_resident"] == pytest.approx(
        row["median_step_s"] / systems["resident"]["median_step_s"])
    assert len(row["round_median_step_s"]) == rounds and row["round_ratios"] == [
        pytest.approx(a / b) for a, b in zip(row["round_median_step_s"],
                                             systems["resident"]["round_median_step_s"])]
  # The pool holds every entry: ula never misses.
  assert systems["ula"]["misses"] == 0
  assert "decode step, every selection hits" in capsys.readouterr().out


def test_resident_is_required_and_rounds_are_counted(capsys):
  with pytest.raises(SystemExit):
    step_cost.main(["--systems", "ula", *TINY])
  with pytest.raises(SystemExit):
    step_cost.main(["--systems", "resident", "--rounds", "0", *TINY])
  assert "--rounds=0: expected an integer >= 1" in capsys.readouterr().err
  with pytest.raises(ValueError, match=r"rounds=0: expected an integer >= 1"):
    step_cost.measure("experiments/quickstart/config.yaml", TINY, ["resident"], batch=2,
                      prompt=40, output=16, rounds=0)


def test_one_round_builds_one_engine_at_a_time(tmp_path):
  """The default: each system's engine is built, timed once and dropped before the next."""
  out = tmp_path / "s.json"
  assert step_cost.main(["--systems", "resident", "--batch", "2", "--prompt", "40",
                         "--output", "8", "--json", str(out), *TINY]) == 0
  row = json.loads(out.read_text())["systems"]["resident"]
  assert row["round_ratios"] == [1.0] and len(row["round_median_step_s"]) == 1
  assert row["median_step_s"] == row["round_median_step_s"][0]


def test_too_few_output_tokens_for_a_full_dispatch_names_the_length_needed(tmp_path):
  """With N steps per dispatch every engine step admits one request per rank and decodes
  N tokens of each running one: the error names an output length that is enough."""
  with pytest.raises(RuntimeError, match=r"raise --output to at least 9 \(\(--batch 2 \+ 1\) "
                     r"x 3"):
    step_cost.main(["--systems", "resident", "--batch", "2", "--prompt", "40", "--output",
                    "6", "--json", str(tmp_path / "s.json"), *TINY,
                    "engine.steps_per_dispatch=3"])
