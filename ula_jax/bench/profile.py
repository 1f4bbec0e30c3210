"""Where a jitted call's time goes: device kernels, device-busy time and host waits per call,
read from a ``jax.profiler`` trace.

``trace_calls(trace_dir, "decode")`` opens the Perfetto trace that
``jax.profiler.trace(dir, create_perfetto_trace=True)`` wrote, finds every host-side
dispatch of the jitted function (``PjitFunction(decode)``) and splits the trace into one
window per call, from its dispatch to the next dispatch of any jitted function (but
those named in ``also``: a step's second call, e.g. ``redo`` after ``speculate``). In each
window it counts the device's operations (events on the device's stream lines: kernels,
memory copies) and the union of their intervals (the device-busy time), and the host
events whose names say the host waited for the device (a conditional's or a loop's
predicate read back, a stream synchronisation). A call whose wall time is far above its
device-busy time is bound by launches and host round trips, not by the device's work.

On a CPU backend the trace has no device lines: the counts are then zero and only the
windows' wall times are meaningful.
"""

from __future__ import annotations

import bisect
import collections
import collections.abc
import gzip
import json
import pathlib
import re
import statistics

# Host-side events that stand for the host waiting on the device.
HOST_WAIT_WORDS = ("BlockHostUntilDone", "Synchronize", "ConditionalThunk", "WhileThunk",
                   "Memcpy D2H", "MemcpyD2H")


def find_trace(trace_dir: str | pathlib.Path) -> pathlib.Path:
  """The newest ``perfetto_trace.json.gz`` under ``trace_dir``."""
  found = sorted(pathlib.Path(trace_dir).glob("**/perfetto_trace.json.gz"),
                 key=lambda p: p.stat().st_mtime)
  if not found:
    raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}: trace with "
                            "jax.profiler.trace(dir, create_perfetto_trace=True)")
  return found[-1]


def _union(intervals: list[tuple[float, float]]) -> float:
  total, end = 0.0, float("-inf")
  for a, b in sorted(intervals):
    if b <= end:
      continue
    total += b - max(a, end)
    end = b
  return total


def _names(events: list[dict]) -> tuple[dict, dict]:
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") != "M":
      continue
    if e.get("name") == "process_name":
      procs[e["pid"]] = e.get("args", {}).get("name", "")
    elif e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
  return procs, threads


def is_device_process(name: str) -> bool:
  return "/device:" in name and "CPU" not in name


# Lines xprof derives from the operations (the same events again, grouped).
DERIVED_LINES = ("Steps", "XLA Modules", "XLA Ops", "Framework", "Source", "TraceMe",
                 "Launch Stats")


def _op_lines(device_lines: set[str]) -> set[str]:
  """The device lines that hold the operations themselves: the stream lines, or where
  the trace names none so, every line that is not a derived one."""
  streams = {l for l in device_lines if "Stream" in l}
  return streams or {l for l in device_lines if not any(w in l for w in DERIVED_LINES)}


def op_kind(name: str) -> str:
  """A device operation's name without XLA's numbering (``loop_add_fusion_12`` ->
  ``loop_add_fusion``, ``fusion.3`` -> ``fusion``): the same fusion gets another number
  in another program."""
  return re.sub(r"([._]\d+)+$", "", name)


def trace_calls(trace_dir: str | pathlib.Path, functions: str | tuple[str, ...],
                also: tuple[str, ...] = (), *, top: int = 25,
                only: collections.abc.Sequence[int] | None = None) -> dict:
  """Per-call device and host counts of the dispatches of ``functions`` in the trace.

  A call's window runs from its dispatch to the next dispatch of any jitted function but
  those named in ``also`` (calls that belong to the same step, e.g. a step run again).
  A device operation counts for the window its start falls in, so the per-call counts
  hold for calls that wait for their results (as engine steps do); calls dispatched
  back to back without waiting lend their operations to later windows.
  returns {"calls": [{"wall_us", "device_ops", "device_busy_us", "memcpy", "host_waits"}],
  "top_ops": [[name, count per call, us per call]] (device), "top_kinds": the same by
  ``op_kind`` (names without XLA's per-program numbering, so that two programs' profiles
  compare), "host_top": [[name, count per call, us per call]] (host events in the
  windows, nested ones counted in each), "lines": {device line: events}, "trace": path};
  times in microseconds. ``only``: the calls (indices into "calls") that the per-call
  tables average over (default: every call), e.g. a serving run's full-batch steps.
  """
  functions = (functions,) if isinstance(functions, str) else tuple(functions)
  path = find_trace(trace_dir)
  with gzip.open(path, "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  procs, threads = _names(events)
  line_of = lambda e: threads.get((e["pid"], e.get("tid")), "")
  device, host, dispatches = [], [], []
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    name = str(e.get("name", ""))
    if is_device_process(procs.get(e["pid"], "")):
      device.append(e)
    elif name.startswith("PjitFunction("):
      dispatches.append(e)
    elif not name.startswith("$"):  # Python frames left out
      host.append(e)
  outer = []  # outermost dispatches only (the profiler nests one in another)
  for e in sorted(dispatches, key=lambda e: (e["ts"], -e["dur"])):
    if not outer or e["ts"] >= outer[-1]["ts"] + outer[-1]["dur"]:
      outer.append(e)
  step_names = {f"PjitFunction({f})" for f in functions}
  inner_names = {f"PjitFunction({f})" for f in also}
  starts, ends = [], []
  for e in outer:
    if e["name"] in inner_names:
      continue
    if starts and ends[-1] == float("inf"):  # any other dispatch ends the open window
      ends[-1] = e["ts"]
    if e["name"] in step_names:
      starts.append(e["ts"])
      ends.append(float("inf"))

  def window(e) -> int:  # the call whose window holds the event's start, or -1
    i = bisect.bisect_right(starts, e["ts"]) - 1
    return i if i >= 0 and e["ts"] < ends[i] else -1

  keep = _op_lines({line_of(e) for e in device})
  ops: list[list[dict]] = [[] for _ in starts]
  for e in device:
    if line_of(e) in keep and (i := window(e)) >= 0:
      ops[i].append(e)
  host_names: dict[str, list[float]] = collections.defaultdict(list)
  waits = [0] * len(starts)
  counted = set(range(len(starts)) if only is None else only)
  for e in host:
    if (i := window(e)) >= 0:
      if i in counted:
        host_names[str(e.get("name", ""))].append(e["dur"])
      waits[i] += any(w in str(e.get("name", "")) for w in HOST_WAIT_WORDS)
  calls = []
  per_name: dict[str, list[float]] = collections.defaultdict(list)
  for i, (s, t, inside, w) in enumerate(zip(starts, ends, ops, waits)):
    last = max((e["ts"] + e["dur"] for e in inside), default=s)
    calls.append({
        "wall_us": (last if t == float("inf") else t) - s,
        "device_ops": len(inside),
        "device_busy_us": _union([(e["ts"], e["ts"] + e["dur"]) for e in inside]),
        "memcpy": sum("emcpy" in str(e.get("name", "")) for e in inside),
        "host_waits": w,
    })
    if i in counted:
      for e in inside:
        per_name[str(e.get("name", ""))].append(e["dur"])
  n = max(len(counted & set(range(len(calls)))), 1)
  top_ops = sorted(([name, len(d) / n, sum(d) / n] for name, d in per_name.items()),
                   key=lambda r: -r[2])[:top]
  per_kind: dict[str, list[float]] = collections.defaultdict(list)
  for name, d in per_name.items():
    per_kind[op_kind(name)].extend(d)
  top_kinds = sorted(([k, len(d) / n, sum(d) / n] for k, d in per_kind.items()),
                     key=lambda r: -r[2])[:top]
  host_top = sorted(([name, len(d) / n, sum(d) / n] for name, d in host_names.items()),
                    key=lambda r: -r[2])[:top]
  lines = collections.Counter(f"{procs[e['pid']]} / {line_of(e)}" for e in device)
  return {"calls": calls, "top_ops": top_ops, "top_kinds": top_kinds, "host_top": host_top,
          "lines": dict(lines.most_common(20)), "trace": str(path)}


def device_op_events(trace_dir: str | pathlib.Path, after: str | None = None) -> list[dict]:
  """The device's operations (events on its operation lines) in time order; with
  ``after``, only those that start after the first host event named ``after`` began
  (e.g. a ``jax.profiler.TraceAnnotation`` around the calls to count, after untimed
  ones). Read once, they serve ``totals_by_name`` and ``launches_of``."""
  with gzip.open(find_trace(trace_dir), "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  procs, threads = _names(events)
  device = [e for e in events if e.get("ph") == "X" and "dur" in e
            and is_device_process(procs.get(e["pid"], ""))]
  keep = _op_lines({threads.get((e["pid"], e.get("tid")), "") for e in device})
  ops = [e for e in device if threads.get((e["pid"], e.get("tid")), "") in keep]
  if after is not None:
    marks = [e["ts"] for e in events if e.get("ph") == "X" and e.get("name") == after
             and not is_device_process(procs.get(e["pid"], ""))]
    if not marks:
      raise ValueError(f"no host event named {after!r} in the trace under {trace_dir}")
    ops = [e for e in ops if e["ts"] >= min(marks)]
  return sorted(ops, key=lambda e: e["ts"])


def totals_by_name(ops: list[dict], *, top: int = 25) -> list[list]:
  """``[name, count, us]`` per operation name of ``device_op_events``, slowest first."""
  per_name: dict[str, list[float]] = collections.defaultdict(list)
  for e in ops:
    per_name[str(e.get("name", ""))].append(e["dur"])
  return sorted(([name, len(d), sum(d)] for name, d in per_name.items()),
                key=lambda r: -r[2])[:top]


def launches_of(ops: list[dict], prefix: str) -> list[dict]:
  """Each of ``device_op_events`` whose name starts with ``prefix``, in time order:
  ``{"name", "us", "idle_before_us", "before"}`` -- its duration, the device's idle time
  between the end of the operation before it and its start, and that operation's name
  (None for the first)."""
  out, end, before = [], None, None
  for e in ops:
    name = str(e.get("name", ""))
    if name.startswith(prefix):
      out.append({"name": name, "us": e["dur"],
                  "idle_before_us": None if end is None else max(0.0, e["ts"] - end),
                  "before": before})
    if end is None or e["ts"] + e["dur"] > end:
      end, before = e["ts"] + e["dur"], name
  return out


def device_ops(trace_dir: str | pathlib.Path, *, top: int = 25) -> list[list]:
  """Every device operation of the trace, by name: ``[name, count, us]`` (totals over
  the whole trace, slowest first; an AOT-compiled call has no dispatch event to window
  by). Empty on a backend without device lines."""
  return totals_by_name(device_op_events(trace_dir), top=top)


def summarize_calls(calls: list[dict]) -> dict:
  """Medians over calls of each per-call count (an empty dict for no calls)."""
  if not calls:
    return {}
  return {k: statistics.median(c[k] for c in calls) for k in calls[0]}


__all__ = ["device_op_events", "device_ops", "find_trace", "launches_of", "op_kind",
           "summarize_calls", "totals_by_name", "trace_calls"]
