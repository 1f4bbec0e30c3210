"""Throughput: decode tokens/s against running batch, up to each system's capacity.

``bench.serving``'s measurement: each system at equal device and host budgets per
device, its capacity in requests of ``context`` tokens (the engine's admission rule on
its sizing), then for each running batch of ``batches`` it can hold and at its capacity,
an engine with that many decode rows serves that many requests arriving together; the
figure is the median decode-step time over the steps in which the whole batch decodes
(the step that compiles is never counted), as tokens per second. A system's peak is
its best point.

UlaCache's claim (GLM-5.3, 64K-128K summarisation, MTP on): peak throughput over
HiSparse x1.16 on H200s in DP and x1.70 in TP; the gains come from admitted
concurrency, the same-batch step time is unchanged.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, model_validator

from ula_jax.experiments.base import (RESULTS, AnchorPoint, Check, Context, Experiment,
                                      Outcome, anchor_panel)
from ula_jax.experiments.common import LABELS, ServingParams, serving_args

ANCHOR_DP, ANCHOR_TP = 1.16, 1.70


class ThroughputParams(ServingParams):
  context: int = Field(256, ge=2, description="tokens per request (prompt + output)")
  batches: list[int] = Field(
      default_factory=lambda: [1, 2],
      description="running batches (all devices) measured below each system's capacity; "
      "the capacity itself is always measured")
  decode_steps: int = Field(4, ge=1, description="full-batch decode steps wanted per point")
  prefill: Literal["synthetic", "compute"] = Field(
      "synthetic", description="workload.prefill: synthetic prompt KV (decode is what is "
      "measured) or the model's own prefill")
  prefill_chunk: int | None = Field(
      None, ge=1, description="engine.prefill_chunk (default: a whole prompt per step)")
  profile: bool = Field(
      False, description="serve each system's capacity point once more under jax's "
      "profiler and add to it, per full-batch decode step, the device's time by kind of "
      "kernel (the traces go to a temporary folder, removed after)")
  reuse: list[str] = Field(
      default_factory=list, description="earlier throughput run directories, run with the "
      "same parameters but systems and reuse: their systems' capacities and points are "
      "taken as measured instead of measuring them again (one experiment over several "
      "time-limited calls: systems=[a] in one, systems=[a,b] reuse=[DIR] in the next)")

  # Each ``reuse`` directory's results.json, read once when the parameters are checked.
  _reused: list[dict] = PrivateAttr(default_factory=list)

  @model_validator(mode="after")
  def _reusable(self) -> ThroughputParams:
    ours = _comparable(self.model_dump(mode="json"))
    self._reused = [_reused_results(i, d) for i, d in enumerate(self.reuse)]
    for i, (d, res) in enumerate(zip(self.reuse, self._reused)):
      theirs = _comparable(res.get("params", {}))
      diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
      if diff:
        raise ValueError(f"reuse[{i}]={d!r} was run with other parameters: " + "; ".join(
            f"{k}={theirs.get(k)!r} there, {ours.get(k)!r} here" for k in diff))
    return self


def _comparable(params: dict) -> dict:
  """The parameters two runs must share for one's points to stand in the other's."""
  return {k: v for k, v in params.items() if k not in ("systems", "reuse", "profile")}


def _reused_results(i: int, d: str) -> dict:
  path = Path(d) / RESULTS
  if not path.is_file():
    raise ValueError(f"reuse[{i}]={d!r}: no {RESULTS} there (a throughput run directory)")
  try:
    res = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"reuse[{i}]={d!r}: {RESULTS} is not JSON ({e})") from None
  if res.get("experiment") != "throughput" or "serving" not in res.get("data", {}):
    raise ValueError(f"reuse[{i}]={d!r}: not a throughput run (experiment "
                     f"{res.get('experiment')!r})")
  return res


def measure(p: ThroughputParams, ctx: Context) -> dict:
  """``bench serving``'s measurement with the parameters: each system's capacity, then a
  point per running batch it can hold and at its capacity (``common.measure_point``)."""
  from ula_jax.bench import serving

  from ula_jax.experiments.common import base_config, measure_point, setups

  args = serving_args(p, context=p.context, batch_list=sorted(set(p.batches)),
                      decode_steps=p.decode_steps, prefill_chunk=p.prefill_chunk)
  args.overrides = args.overrides + [f"workload.prefill={p.prefill}"]
  base = base_config(p)
  result = {"devices": p.devices, "context": p.context, "model": base.model.preset,
            "top_k": base.model.index_topk, "device_budget": str(p.device_budget),
            "host_budget": str(p.host_budget), "systems": {}}
  reused = {}  # system -> its entry from the first reuse directory that has it
  for d, res in zip(p.reuse, p._reused):
    for name, e in res["data"]["serving"]["systems"].items():
      if name in p.systems and name not in reused:
        # Where and when it was measured: the machine, date and versions of that run
        # (an entry that run itself reused keeps its own).
        reused[name] = {"reused_from": str(d), "reused_environment": res.get("environment"),
                        **e}
  for name, s in setups(p, base.model.index_topk).items():
    if name in reused:
      entry = result["systems"][name] = reused[name]
      d = entry["reused_from"]
      ctx.log(f"  {name:12s} capacity and {len(entry['points'])} points from {d}")
      continue
    cap = serving.capacity(args, s)
    entry = {"dp": s.dp, "tp": s.tp, "overrides": list(s.overrides), "capacity": cap,
             "points": []}
    result["systems"][name] = entry
    for b in serving.batches_for(args, s, cap["requests"]):
      try:
        if p.profile and b == cap["requests"]:
          with tempfile.TemporaryDirectory() as tmp:
            entry["points"].append(serving.run_point(args, s, b, f"{tmp}/{name}"))
          del entry["points"][-1]["profile"]["trace"]
        else:
          entry["points"].append(measure_point(args, s, b))
      except Exception as e:  # noqa: BLE001 -- recorded; the other points still run
        entry["points"].append({"system": name, "batch": b,
                                "error": f"{type(e).__name__}: {e}"[:500]})
      pt = entry["points"][-1]
      ctx.log(f"  {name:12s} batch {b:4d}: " + (pt["error"] if pt.get("error") else
              f"{pt['median_step_s'] * 1e3:8.2f} ms/step {pt['tokens_per_s']:9.1f} tok/s"))
      if pt.get("profile"):
        pr = pt["profile"]
        ctx.log(f"  {'':12s} profiled: wall {pr.get('wall_us', 0) / 1e3:.3f} ms, device "
                f"busy {pr.get('device_busy_us', 0) / 1e3:.3f} ms; " + ", ".join(
                    f"{k} {us / 1e3:.3f}" for k, _, us in pr["top_kinds"][:8]))
  return result


def run(p: ThroughputParams, ctx: Context) -> Outcome:
  from ula_jax.bench.serving import peak

  result = measure(p, ctx)
  systems = result["systems"]
  rows = []
  for name, e in systems.items():
    pk = peak(e)
    for pt in sorted(e["points"], key=lambda x: x["batch"]):
      ok = not pt.get("error")
      rows.append({"system": name, "dp x tp": f"{e['dp']}x{e['tp']}",
                   "capacity": e["capacity"]["requests"], "batch": pt["batch"],
                   "tokens/s": pt["tokens_per_s"] if ok else None,
                   "ms / step": pt["median_step_s"] * 1e3 if ok else None,
                   "admitted": pt.get("peak_admitted"),
                   "peak": bool(ok and pk is not None and pt["batch"] == pk["batch"]),
                   "error": pt.get("error", "")[:80]})
  peaks = {n: (peak(e) or {}).get("tokens_per_s") for n, e in systems.items()}
  anchor = []
  for name, value in (("ula_dp", ANCHOR_DP), ("ula_tp", ANCHOR_TP)):
    ours = peaks.get(name), peaks.get("hisparse")
    anchor.append(AnchorPoint(f"{LABELS[name]} peak / HiSparse peak",
                              ours[0] / ours[1] if all(ours) else None, value, "UlaCache"))
  checks = _checks(systems)

  def draw(fig):
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    for name, e in systems.items():
      ok = sorted((x for x in e["points"] if not x.get("error")), key=lambda x: x["batch"])
      if not ok:
        continue
      line, = ax1.plot([x["batch"] for x in ok], [x["tokens_per_s"] for x in ok],
                       marker="o", label=f"{LABELS[name]} (capacity "
                       f"{e['capacity']['requests']})")
      pk = peak(e)
      ax1.plot([pk["batch"]], [pk["tokens_per_s"]], marker="*", ms=14,
               color=line.get_color())
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("running batch (requests decoding, all devices)")
    ax1.set_ylabel("decode tokens/s")
    ax1.set_title(f"{result['devices']} device(s), {p.model}, context "
                  f"{result['context']}; star: peak", fontsize="medium")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize="small")
    anchor_panel(ax2, anchor)

  notes = [f"{n}: capacity limited by {e['capacity']['limit']}" for n, e in systems.items()]
  notes += [f"{n}: measured in {e['reused_from']} (reuse)" for n, e in systems.items()
            if e.get("reused_from")]
  return Outcome(title=f"decode tokens/s against running batch, context {p.context}",
                 columns=["system", "dp x tp", "capacity", "batch", "tokens/s", "ms / step",
                          "admitted", "peak", "error"],
                 rows=rows, data={"serving": result, "peaks": peaks}, checks=checks,
                 anchor=anchor, draw=draw, notes=notes)


def _checks(systems: dict) -> list[Check]:
  errors = [f"{n} batch {x['batch']}" for n, e in systems.items() for x in e["points"]
            if x.get("error")]
  out = [Check("every point decoded its whole batch", not errors,
               f"failed: {errors}" if errors else
               f"{sum(len(e['points']) for e in systems.values())} points")]
  held = [f"{n}: admitted {x['peak_admitted']} of {x['batch']}" for n, e in systems.items()
          for x in e["points"] if not x.get("error") and x["peak_admitted"] != x["batch"]]
  out.append(Check("the engine held each point's batch at once", not held,
                   "; ".join(held) if held else "every point"))
  reached = [n for n, e in systems.items() if e["capacity"]["requests"]
             and e["capacity"]["requests"] not in {x["batch"] for x in e["points"]
                                                   if not x.get("error")}]
  out.append(Check("every system was measured at its capacity", not reached,
                   f"not: {reached}" if reached else "every system"))
  return out


def devices(p: ThroughputParams) -> tuple[str, int]:
  return p.platform, p.devices


EXPERIMENT = Experiment(
    name="throughput",
    question="What decode throughput does each system reach as the running batch grows "
    "to its capacity, at equal budgets?",
    anchor="UlaCache: peak throughput over HiSparse x1.16 on H200 in DP, x1.70 in TP "
    "(from admitted concurrency; same-batch step time unchanged)",
    params=ThroughputParams, run=run, devices=devices)
