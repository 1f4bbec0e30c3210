"""Synthetic and file workloads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ula_jax.config import ConfigError, WorkloadConfig, validate
from ula_jax.engine.types import Request
from ula_jax.workloads import (WorkloadError, arrival_steps, build_requests, file_lengths,
                               file_requests, synthetic_requests, zipf_tokens)


def wl(**kw) -> WorkloadConfig:
  return WorkloadConfig(**{"prompt_len": (100, 200), "output_len": (10, 20), **kw})


# ----------------------------------------------------------------------------------
# synthetic
# ----------------------------------------------------------------------------------


def test_synthetic_requests_are_seeded_and_in_range(seed):
  cfg = wl(seed=seed, num_requests=12, length_scale=0.5, output_scale=2.0)
  reqs = synthetic_requests(cfg, vocab_size=300)
  assert len(reqs) == 12 and all(isinstance(r, Request) for r in reqs)
  assert [r.id for r in reqs] == [f"req-{i:04d}" for i in range(12)]
  for r in reqs:
    assert 50 <= r.prompt_len <= 100
    assert 20 <= r.max_new_tokens <= 40
    assert r.prompt.dtype == np.int32
    assert r.prompt.min() >= 0 and r.prompt.max() < 300
    assert r.arrival_step == 0
  again = synthetic_requests(cfg, vocab_size=300)
  for a, b in zip(reqs, again):
    assert a.max_new_tokens == b.max_new_tokens and np.array_equal(a.prompt, b.prompt)
  other = synthetic_requests(wl(seed=seed + 1, num_requests=12, length_scale=0.5,
                                output_scale=2.0), vocab_size=300)
  assert any(not np.array_equal(a.prompt, b.prompt) for a, b in zip(reqs, other))


def test_lengths_do_not_depend_on_the_vocabulary(seed):
  cfg = wl(seed=seed, num_requests=6)
  a = synthetic_requests(cfg, vocab_size=50)
  b = synthetic_requests(cfg, vocab_size=5000)
  assert [r.prompt_len for r in a] == [r.prompt_len for r in b]
  assert [r.max_new_tokens for r in a] == [r.max_new_tokens for r in b]


def test_lengths_cover_the_whole_range(seed):
  reqs = synthetic_requests(wl(seed=seed, num_requests=400, prompt_len=(3, 5),
                               output_len=(1, 2)), vocab_size=10)
  assert {r.prompt_len for r in reqs} == {3, 4, 5}
  assert {r.max_new_tokens for r in reqs} == {1, 2}


def test_tiny_scales_still_give_one_token():
  reqs = synthetic_requests(wl(prompt_len=(1, 2), length_scale=0.01, output_len=(1, 1),
                               output_scale=0.01, num_requests=3), vocab_size=7)
  assert all(r.prompt_len == 1 and r.max_new_tokens == 1 for r in reqs)


def test_zipf_frequencies_follow_one_over_rank():
  # Exponent 1 over 4 ids: probabilities 1, 1/2, 1/3, 1/4 over H_4 = 25/12.
  rng = np.random.default_rng(0)
  tokens = zipf_tokens(rng, 200_000, vocab_size=4, exponent=1.0)
  freq = np.bincount(tokens, minlength=4) / tokens.size
  expected = np.array([12, 6, 4, 3]) / 25
  np.testing.assert_allclose(freq, expected, atol=0.005)
  ranking = np.array([2, 0, 3, 1])
  permuted = zipf_tokens(np.random.default_rng(0), 1000, 4, exponent=1.0, ranking=ranking)
  np.testing.assert_array_equal(permuted, ranking[tokens[:1000]])


def test_zipf_rejects_an_empty_vocabulary():
  with pytest.raises(ValueError, match=r"vocab_size=0: must be >= 1"):
    zipf_tokens(np.random.default_rng(0), 5, 0)


def test_arrivals(seed):
  rng = np.random.default_rng(seed)
  np.testing.assert_array_equal(arrival_steps(rng, 5, "all_at_once", 1.0), np.zeros(5))
  steps = arrival_steps(rng, 4000, "poisson", 0.5)
  assert steps[0] == 0 and np.all(np.diff(steps) >= 0)
  # Mean gap 1 / rate = 2 steps (flooring the cumulative times keeps the mean).
  assert abs(steps[-1] / (len(steps) - 1) - 2.0) < 0.15
  with pytest.raises(ValueError, match=r"workload.arrival='burst': expected one of"):
    arrival_steps(rng, 3, "burst", 1.0)


def test_poisson_workload_spreads_arrivals(seed):
  reqs = synthetic_requests(wl(seed=seed, num_requests=50, arrival="poisson",
                               arrival_rate=0.25), vocab_size=10)
  steps = [r.arrival_step for r in reqs]
  assert steps[0] == 0 and steps == sorted(steps) and steps[-1] > 50


def test_build_requests_uses_the_model_vocabulary():
  cfg = validate({"experiment": {"name": "w"}, "model": {"preset": "tiny", "vocab_size": 17},
                  "workload": {"length_scale": 0.001, "num_requests": 3}})
  reqs = build_requests(cfg)
  assert len(reqs) == 3 and max(int(r.prompt.max()) for r in reqs) < 17
  assert all(66 <= r.prompt_len <= 131 for r in reqs)


# ----------------------------------------------------------------------------------
# files
# ----------------------------------------------------------------------------------


def test_jsonl_file(tmp_path):
  path = tmp_path / "reqs.jsonl"
  path.write_text('{"id": "a", "prompt": [1, 2, 3], "max_new_tokens": 4}\n'
                  '\n'
                  '{"id": 7, "prompt_len": 5, "max_new_tokens": 2, "arrival_step": 3}\n')
  reqs = file_requests(path, vocab_size=10, seed=1)
  assert [r.id for r in reqs] == ["a", "7"]
  np.testing.assert_array_equal(reqs[0].prompt, [1, 2, 3])
  assert reqs[0].prompt.dtype == np.int32
  assert (reqs[0].max_new_tokens, reqs[0].arrival_step) == (4, 0)
  assert reqs[1].prompt_len == 5 and reqs[1].arrival_step == 3
  assert reqs[1].prompt.max() < 10
  np.testing.assert_array_equal(reqs[1].prompt, file_requests(path, 10, seed=1)[1].prompt)
  assert file_lengths(path) == [(3, 4), (5, 2)]


def test_json_list_file(tmp_path):
  path = tmp_path / "reqs.json"
  path.write_text(json.dumps([{"id": "x", "prompt": [0], "max_new_tokens": 1},
                              {"id": "y", "prompt_len": 2, "max_new_tokens": 1}]))
  assert [r.prompt_len for r in file_requests(path, 4)] == [1, 2]


@pytest.mark.parametrize("text,match", [
    ('{"id": "a", "prompt": [1], "max_new_tokens": 1}\n{"id": "b", "prompt": [1],\n',
     r"reqs.jsonl:2: not valid JSON"),
    ('{"id": "a", "prompt": [1], "max_new_tokens": 1, "arival_step": 2}\n',
     r"reqs.jsonl:1: unknown field 'arival_step' \(did you mean 'arrival_step'\?\)"),
    ('{"prompt": [1], "max_new_tokens": 1}\n', r"reqs.jsonl:1: field 'id' is missing"),
    ('{"id": "a", "max_new_tokens": 1}\n',
     r"reqs.jsonl:1: give exactly one of the fields 'prompt'"),
    ('{"id": "a", "prompt": [1], "prompt_len": 1, "max_new_tokens": 1}\n',
     r"give exactly one of the fields"),
    ('{"id": "a", "prompt": [], "max_new_tokens": 1}\n',
     r"reqs.jsonl:1: field 'prompt' must be a non-empty list of integer token ids"),
    ('{"id": "a", "prompt": [1, "x"], "max_new_tokens": 1}\n', r"field 'prompt' must be"),
    ('{"id": "a", "prompt_len": 0, "max_new_tokens": 1}\n',
     r"reqs.jsonl:1: field 'prompt_len'=0: expected an integer >= 1"),
    ('{"id": "a", "prompt": [1]}\n', r"field 'max_new_tokens'=None: expected an integer >= 1"),
    ('{"id": "a", "prompt": [1], "max_new_tokens": 1, "arrival_step": -1}\n',
     r"field 'arrival_step'=-1: expected an integer >= 0"),
    ('{"id": "a", "prompt": [1], "max_new_tokens": 1}\n{"id": "a", "prompt": [2], '
     '"max_new_tokens": 1}\n', r"reqs.jsonl:2: field 'id'='a' repeats the id of .*reqs.jsonl:1"),
    ('[1, 2]\n', r"reqs.jsonl: entry 0: expected a JSON object"),
    ('[{"id": "a", "prompt": [1], "max_new_tokens": 1},\n', r"reqs.jsonl:2: not valid JSON"),
    ('[]', r"reqs.jsonl: no requests in the file"),
    ('  \n', r"reqs.jsonl: empty request file"),
    ('{"id": "a", "prompt": [1, 99], "max_new_tokens": 1}\n',
     r"reqs.jsonl:1: field 'prompt' has token id 99 outside \[0, 10\) \(model.vocab_size=10\)"),
    # Past int64: still a WorkloadError naming file, line and field (not an OverflowError).
    ('{"id": "a", "prompt": [1], "max_new_tokens": 1}\n'
     '{"id": "b", "prompt": [1, 1000000000000000000000000000000], "max_new_tokens": 1}\n',
     r"reqs.jsonl:2: field 'prompt' has token id 1000000000000000000000000000000 outside"),
    ('{"id": "a", "prompt": [-100000000000000000000000], "max_new_tokens": 1}\n',
     r"reqs.jsonl:1: field 'prompt' has token id -100000000000000000000000 outside"),
])
def test_malformed_files_name_file_line_and_field(tmp_path, text, match):
  path = tmp_path / "reqs.jsonl"
  path.write_text(text)
  with pytest.raises(WorkloadError, match=match):
    file_requests(path, vocab_size=10)


def test_missing_file(tmp_path):
  with pytest.raises(WorkloadError, match=r"workload.path='.*nope.jsonl': no such file"):
    file_lengths(tmp_path / "nope.jsonl")


def test_file_workload_through_the_config(tmp_path):
  path = tmp_path / "reqs.jsonl"
  path.write_text('{"id": "a", "prompt_len": 100, "max_new_tokens": 30}\n'
                  '{"id": "b", "prompt": [1, 2], "max_new_tokens": 3}\n')
  base = {"experiment": {"name": "f"}, "model": {"preset": "tiny"}}
  cfg = validate({**base, "workload": {"kind": "file", "path": str(path)}})
  assert cfg.engine.max_context == 192  # 130 tokens -> 3 pages of 64
  reqs = build_requests(cfg)
  assert [r.total_len for r in reqs] == [130, 5]
  with pytest.raises(ConfigError, match=r"workload.path='.*missing.jsonl': no such file"):
    validate({**base, "workload": {"kind": "file", "path": str(tmp_path / "missing.jsonl")}})
  with pytest.raises(ConfigError,
                     match=r"longest request has 130 tokens .* model.max_position=100"):
    validate({**base, "model": {"preset": "tiny", "max_position": 100},
              "workload": {"kind": "file", "path": str(path)}})
