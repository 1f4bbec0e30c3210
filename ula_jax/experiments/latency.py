"""Latency: time per output token at batch 1 and a small batch, every system.

Each system at equal budgets (``bench.serving``'s setups), one engine per (system,
batch) with that many decode rows serving that many requests of ``context`` tokens
arriving together; TPOT is the median decode-step time over the steps in which the
whole batch decodes (``bench.serving.run_point``). The misses per step say why: at batch
1 the device can hold the whole history, but HiSparse's per-request buffer quota
(``device_buffer_size``) cannot, so it keeps fetching from host memory; ula's one pool
shared by the device's requests holds it all.

HiSparse's claim (8 x B300, DP): at batch 1 its TPOT is 23.5% above GPU-only SGLang.
UlaCache: at batch 1 its TPOT is below HiSparse's and above GPU-only.
"""

from __future__ import annotations

from pydantic import Field

from ula_jax.experiments.base import (AnchorPoint, Check, Context, Experiment, Outcome,
                                      anchor_panel)
from ula_jax.experiments.common import LABELS, serving_args, setups
from ula_jax.experiments.throughput import ThroughputParams

ANCHOR_HISPARSE = 1.235
SKIPPED = "above its capacity:"


class LatencyParams(ThroughputParams):
  batches: list[int] = Field(
      default_factory=lambda: [1, 2],
      description="running batches (all devices): 1 and a small batch")


def run(p: LatencyParams, ctx: Context) -> Outcome:
  from ula_jax.bench.serving import capacity

  from ula_jax.experiments.common import base_config, measure_point

  args = serving_args(p, context=p.context, decode_steps=p.decode_steps,
                      prefill_chunk=p.prefill_chunk)
  args.overrides = args.overrides + [f"workload.prefill={p.prefill}"]
  sets = setups(p, base_config(p).model.index_topk)
  points: dict[str, dict[int, dict]] = {}
  caps = {}
  for name, s in sets.items():
    caps[name] = capacity(args, s)
    points[name] = {}
    for b in sorted(set(p.batches)):
      if b > caps[name]["requests"] or b % s.dp:
        points[name][b] = {"system": name, "batch": b,
                           "error": f"{SKIPPED} capacity {caps[name]['requests']}, dp {s.dp}"}
        continue
      try:
        points[name][b] = measure_point(args, s, b)
      except Exception as e:  # noqa: BLE001 -- recorded; the other points still run
        points[name][b] = {"system": name, "batch": b,
                           "error": f"{type(e).__name__}: {e}"[:300]}
      pt = points[name][b]
      ctx.log(f"  {name:12s} batch {b}: " + (pt["error"] if pt.get("error") else
                                             f"{pt['median_step_s'] * 1e3:.2f} ms/token"))
  ref = next((n for n in ("resident_dp", "resident_tp") if n in sets), None)
  rows = []
  for name, by in points.items():
    for b, pt in by.items():
      ok = not pt.get("error")
      stats = pt.get("full_batch_stats", {}) if ok else {}
      r = points.get(ref, {}).get(b, {}) if ref else {}
      steps = pt.get("steps") or 0
      hits, misses = stats.get("hits"), stats.get("misses")
      rows.append({
          "system": name, "batch": b,
          "TPOT ms": pt["median_step_s"] * 1e3 if ok else None,
          f"/ {ref}": (pt["median_step_s"] / r["median_step_s"]
                       if ok and r and not r.get("error") else None),
          "misses / step": misses / steps if ok and misses is not None and steps else None,
          "hit rate": (hits / (hits + misses) if ok and hits is not None and misses
                       is not None and hits + misses else None),
          "capacity": caps[name]["requests"], "note": pt.get("error", "")[:80]})
  tpot = {n: {b: pt.get("median_step_s") for b, pt in by.items() if not pt.get("error")}
          for n, by in points.items()}
  anchor = []
  b1 = min(p.batches)
  if ref and "hisparse" in tpot:
    h, r = tpot["hisparse"].get(b1), tpot[ref].get(b1)
    anchor.append(AnchorPoint(f"HiSparse / GPU-only TPOT, batch {b1}",
                              h / r if h and r else None, ANCHOR_HISPARSE, "HiSparse"))
  for name in ("ula_dp", "ula_tp"):
    if ref and name in tpot:
      u, r = tpot[name].get(b1), tpot[ref].get(b1)
      anchor.append(AnchorPoint(f"{LABELS[name]} / GPU-only TPOT, batch {b1}",
                                u / r if u and r else None, None, "UlaCache"))
  checks = _checks(p, sets, points, b1)

  def draw(fig):
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    batches = sorted(set(p.batches))
    width = 0.8 / max(len(points), 1)
    for i, (name, by) in enumerate(points.items()):
      xs = [j + (i - (len(points) - 1) / 2) * width for j in range(len(batches))]
      ys = [by[b]["median_step_s"] * 1e3 if not by[b].get("error") else 0 for b in batches]
      ax1.bar(xs, ys, width=width, label=LABELS[name])
      for x, b in zip(xs, batches):
        st = by[b].get("full_batch_stats") or {}
        if "misses" in st and by[b].get("steps"):
          ax1.text(x, ys[batches.index(b)], f"{st['misses'] / by[b]['steps']:.0f}\nmiss",
                   ha="center", va="bottom", fontsize="x-small")
    ax1.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax1.set_ylabel("time per output token (ms)")
    ax1.set_title(f"{p.devices} device(s), {p.model}, context {p.context}; "
                  "labels: misses per step", fontsize="medium")
    ax1.legend(fontsize="small")
    ax1.grid(True, axis="y", alpha=0.3)
    anchor_panel(ax2, anchor)

  return Outcome(title=f"time per output token at batch {', '.join(map(str, sorted(set(p.batches))))}, "
                 f"context {p.context}",
                 columns=["system", "batch", "TPOT ms", f"/ {ref}", "misses / step",
                          "hit rate", "capacity", "note"],
                 rows=rows, data={"points": points, "capacity": caps, "reference": ref},
                 checks=checks, anchor=anchor, draw=draw)


def _checks(p, sets, points, b1) -> list[Check]:
  out = []
  errors = [f"{n} batch {b}" for n, by in points.items() for b, pt in by.items()
            if pt.get("error") and not pt["error"].startswith(SKIPPED)]
  out.append(Check("every point within its system's capacity ran", not errors,
                   f"not: {errors}" if errors else "every one"))
  dev = _tokens(p.device_budget)
  if "ula_dp" in points and b1 in points["ula_dp"] and dev is not None:
    pt = points["ula_dp"][b1]
    if not pt.get("error") and b1 * p.context <= dev:
      m = pt["full_batch_stats"].get("misses", 0)
      out.append(Check(f"ula at batch {b1} keeps the whole history on the device", m == 0,
                       f"{m} misses over {pt['steps']} steps"))
  if "hisparse" in points and b1 in points["hisparse"]:
    pt = points["hisparse"][b1]
    buf = p.hisparse_buffer or 2 * pt.get("top_k", 0)
    if not pt.get("error") and p.hisparse_buffer is not None and buf < p.context:
      m = pt["full_batch_stats"].get("misses", 0)
      out.append(Check(f"HiSparse at batch {b1} misses (its {buf}-slot quota is below "
                       f"the {p.context}-token context)", m > 0,
                       f"{m} misses over {pt['steps']} steps"))
  return out


def _tokens(size) -> int | None:
  """A budget in tokens (None for one given in bytes)."""
  try:
    return int(size)
  except (TypeError, ValueError):
    return None


def devices(p: LatencyParams) -> tuple[str, int]:
  return p.platform, p.devices


EXPERIMENT = Experiment(
    name="latency",
    question="What is each system's time per output token at batch 1 and at a small batch, "
    "when the device could hold every request's whole history?",
    anchor="HiSparse: at batch 1 its TPOT is 23.5% above GPU-only (per-request buffer "
    "quota); UlaCache: below HiSparse, above GPU-only",
    params=LatencyParams, run=run, devices=devices)
