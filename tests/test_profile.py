"""bench.profile: per-call device operations, busy time and host waits from a trace."""

from __future__ import annotations

import gzip
import json

import pytest

from ula_jax.bench.profile import (device_op_events, device_ops, launches_of, op_kind,
                                   summarize_calls, totals_by_name, trace_calls)


def _meta(pid, name, tid=None, thread=None):
  if thread is None:
    return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
  return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}}


def _x(pid, tid, ts, dur, name):
  return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}


def test_trace_calls_splits_the_trace_per_dispatch(tmp_path):
  host, gpu = 1, 2
  events = [
      _meta(host, "/host:CPU"), _meta(host, "", 10, "python"),
      _meta(gpu, "/device:GPU:0"), _meta(gpu, "", 14, "Stream #14(Compute)"),
      _meta(gpu, "", 99, "XLA Ops"),
      # Two decode calls (each reported twice, nested) and a prefill between them.
      _x(host, 10, 0, 50, "PjitFunction(decode)"), _x(host, 10, 1, 48, "PjitFunction(decode)"),
      _x(host, 10, 20, 5, "ConditionalThunk"), _x(host, 10, 30, 2, "$python frame"),
      _x(gpu, 14, 10, 10, "fusion_1"), _x(gpu, 14, 15, 10, "fusion_2"),  # overlap: busy 15
      _x(gpu, 14, 40, 4, "Memcpy D2H"), _x(gpu, 99, 10, 10, "fusion_1"),  # derived line
      _x(host, 10, 100, 10, "PjitFunction(prefill)"), _x(gpu, 14, 105, 30, "fusion_9"),
      _x(host, 10, 200, 20, "PjitFunction(decode)"), _x(gpu, 14, 210, 6, "fusion_1"),
      # A speculative step run again: one window over both calls.
      _x(host, 10, 300, 10, "PjitFunction(speculate)"), _x(gpu, 14, 305, 5, "fusion_1"),
      _x(host, 10, 320, 10, "PjitFunction(redo)"), _x(gpu, 14, 325, 5, "fusion_2"),
      _x(host, 10, 400, 10, "PjitFunction(release)"),
  ]
  d = tmp_path / "plugins" / "profile" / "run"
  d.mkdir(parents=True)
  with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  out = trace_calls(tmp_path, "decode")
  first, second = out["calls"]
  assert second["wall_us"] == 100  # up to the next dispatch, the speculate
  assert first == {"wall_us": 100, "device_ops": 3, "device_busy_us": 19, "memcpy": 1,
                   "host_waits": 1}
  assert second == {"wall_us": 100, "device_ops": 1, "device_busy_us": 6, "memcpy": 0,
                    "host_waits": 0}
  steps = trace_calls(tmp_path, ("decode", "speculate"), also=("redo",))["calls"]
  assert [c["device_ops"] for c in steps] == [3, 1, 2]
  assert steps[2]["wall_us"] == 100 and steps[2]["device_busy_us"] == 10
  assert out["top_ops"][0] == ["fusion_1", 1.0, 8.0]
  # By kind: fusion_1 and fusion_2 are one kind (per call: 3 ops, 10 + 10 + 6 us / 2).
  assert out["top_kinds"][0] == ["fusion", 1.5, 13.0]
  assert [n for n, _, _ in out["host_top"]] == ["ConditionalThunk"]  # no Python frames
  # only=: the per-call tables over the second call alone; every call still listed.
  second_only = trace_calls(tmp_path, "decode", only=[1])
  assert second_only["calls"] == out["calls"]
  assert second_only["top_ops"] == [["fusion_1", 1.0, 6.0]]
  assert second_only["top_kinds"] == [["fusion", 1.0, 6.0]] and second_only["host_top"] == []
  assert summarize_calls(out["calls"])["device_ops"] == 2
  assert summarize_calls(steps)["device_ops"] == 2
  assert summarize_calls([]) == {}
  # The whole trace by name (no windows; the derived line left out).
  assert device_ops(tmp_path)[:2] == [["fusion_9", 1, 30], ["fusion_1", 3, 21]]
  # Each launch of one kernel, with the device's idle time before it.
  events = device_op_events(tmp_path)
  launches = launches_of(events, "fusion_1")
  assert [(l["us"], l["idle_before_us"], l["before"]) for l in launches] == [
      (10, None, None), (6, 75, "fusion_9"), (5, 89, "fusion_1")]
  assert launches_of(events, "fusion_2")[0]["idle_before_us"] == 0  # overlaps
  # From the first host event of a name on (the prefill's dispatch at 100).
  late = device_op_events(tmp_path, after="PjitFunction(prefill)")
  assert totals_by_name(late)[:2] == [["fusion_9", 1, 30], ["fusion_1", 2, 11]]
  assert [l["before"] for l in launches_of(late, "fusion_1")] == ["fusion_9", "fusion_1"]
  with pytest.raises(ValueError, match="no host event named 'nothing'"):
    device_op_events(tmp_path, after="nothing")
  with pytest.raises(FileNotFoundError):
    trace_calls(tmp_path / "none", "decode")


def test_op_kind_drops_the_numbering():
  assert op_kind("loop_add_fusion_12") == "loop_add_fusion"
  assert op_kind("fusion.3") == "fusion"
  assert op_kind("input_concatenate_fusion_1_2") == "input_concatenate_fusion"
  assert op_kind("ula_resolve_fused") == "ula_resolve_fused"
  assert op_kind("memcpy32_post") == "memcpy32_post"
  assert op_kind("MemcpyD2D") == "MemcpyD2D"
