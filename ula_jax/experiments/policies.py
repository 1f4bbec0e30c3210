"""Policies: PB-LRU against exact LRU, hit rate and resolve time against batch.

Hit rate: the trained model's selections (``experiments/traces``) served at each batch
of ``batches`` (``selections.build``: request ``i`` replays recorded request
``i mod R``), replayed through one ula DP rank (the NumPy model of ``Ula``, which makes
the jax resolve's choices) under ``pb_lru`` and ``lru`` with the same pools: a device
pool of ``pool_factor x (k + 1)`` slots per decode row, tight enough that steps evict,
and a host pool for the rest.

Resolve time: ``bench resolve`` (one layer group's resolve, ``resolve_impls``) at each
batch of ``resolve_batches`` under both policies, on its own stream (every request's
selection kept from step to step but for ``resolve_churn`` of it, redrawn; the device
pool full, half the entries on the host).

Ring size: PB-LRU keeps exact LRU order only among slots touched at most ``R`` rounds
apart (``memory.pb_lru_buckets``); older slots are equally cold and leave in slot order.
``bucket_sweep`` replays the largest batch under PB-LRU with each ``R`` listed (the hit
rate's gap to exact LRU against ``R``), and ``resolve_bucket_sweep`` times ``bench
resolve``'s PB-LRU at the largest of ``resolve_batches`` with each ``R`` listed (what a
longer ring costs the resolve).

UlaCache's claim: PB-LRU's hit rate is within 0.1 percentage points of exact LRU's, and
its scheduling 1.5-2.3x faster at large batch (slower when there are few evictions).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal

from pydantic import Field

from ula_jax.config.schema import PB_LRU_BUCKETS
from ula_jax.experiments.base import (AnchorPoint, Check, Context, Experiment, Outcome,
                                      Params, anchor_panel, repo_path)

SELECTIONS = "experiments/traces/trained_small.npz"


class TraceParams(Params):
  """The trained model's selections and how much of them a run replays."""

  selections: str = Field(SELECTIONS, description="selections file (experiments/traces)")
  steps: int | None = Field(None, ge=1, description="decode steps per request; None = all")
  groups: list[int] | None = Field(
      None, description="layer groups of the recorded model to keep; None = all")
  page_size: int = Field(64, ge=1, description="engine.page_size of the served traces")

  def load(self):
    from ula_jax.experiments.selections import Selections
    return Selections.load(repo_path(self.selections)).subset(steps=self.steps,
                                                              groups=self.groups)


def build_trace(p: TraceParams, sel, tmp: str | Path, *, requests: int, batch: int):
  """The trace of ``requests`` requests of ``sel`` on ``batch`` rows, loaded."""
  from ula_jax.experiments.selections import build
  from ula_jax.memory.traces import SelectionTrace

  path = build(sel, Path(tmp) / f"b{batch}_r{requests}.npz", requests=requests, batch=batch,
               page_size=p.page_size)
  return SelectionTrace.load(path)


def replay_ula(trace, *, device_pool: int, policy: str, buckets: int | None = None):
  """One ula DP rank of ``device_pool`` device slots and a host pool for the rest,
  replayed (NumPy model): hits, misses, evictions and seconds."""
  from ula_jax.config.schema import MemoryConfig
  from ula_jax.memory.traces.replay import build_rank_system, replay

  B = trace.max_batch
  cfg = MemoryConfig(system="ula", device_pool=device_pool,
                     host_pool=max(trace.num_logical, trace.page_size), policy=policy,
                     pb_lru_buckets=buckets or PB_LRU_BUCKETS)
  system = build_rank_system(cfg, trace.geometry(), max_batch=B, page_size=trace.page_size,
                             max_context=max(trace.num_logical // B, 1))
  r = replay(trace, system, engine="fast", report_every=1 << 30, validate=False)
  tot = r.totals()
  looked = tot["hits"] + tot["misses"]
  return {**tot, "hit_rate": tot["hits"] / looked if looked else None,
          "steps": trace.num_steps, "replay_s": r.seconds, "device_slots": system.device_slots}


class PoliciesParams(TraceParams):
  batches: list[int] = Field(default_factory=lambda: [1, 2, 4],
                             description="decode rows the selections are served on")
  pool_factor: float = Field(
      1.5, gt=0, description="ula device pool per decode row, in selections (k + 1 slots)")
  buckets: int | None = Field(None, ge=1, description="memory.pb_lru_buckets; None = its "
                              "default")
  bucket_sweep: list[int] = Field(
      default_factory=lambda: [1, 2, 4, 8, 16, 32, 64],
      description="PB-LRU ring sizes replayed at the largest batch (none: skip)")
  resolve_bucket_sweep: list[int] = Field(
      default_factory=list, description="ring sizes bench resolve times PB-LRU with, at the "
      "largest of resolve_batches (none: skip)")
  resolve_batches: list[int] = Field(default_factory=lambda: [1, 4],
                                     description="bench resolve's batches (none: skip it)")
  resolve_k: int | None = Field(None, ge=1, description="bench resolve's top-k; None = the "
                                "selections'")
  resolve_pool: int = Field(4096, ge=1, description="bench resolve's device pool slots")
  resolve_impls: list[Literal["jnp", "pallas"]] = Field(
      default_factory=lambda: ["jnp"], description="bench resolve's implementations")
  resolve_fuse: list[Literal["off", "on"]] = Field(
      default_factory=lambda: ["off"], description="Pallas launch forms (on: PB-LRU fused)")
  resolve_churn: float = Field(0.1, ge=0, le=1, description="bench resolve's churn")
  resolve_steps: int = Field(8, ge=1, description="resolves per timed segment")
  resolve_segments: int = Field(2, ge=1, description="timed segments (median)")
  platform: Literal["cpu", "gpu"] = "cpu"


def resolve_times(p: PoliciesParams, k: int, *, batches: list[int] | None = None,
                  policies: str = "pb_lru,lru", buckets: int | None = None) -> dict:
  """``bench resolve`` at the parameters' sizes (its parser, its run)."""
  from ula_jax.bench import resolve

  argv = ["--batch", ",".join(map(str, batches or p.resolve_batches)),
          "--k", str(p.resolve_k or k), "--pools", str(p.resolve_pool),
          "--policies", policies, "--impls", ",".join(p.resolve_impls),
          "--pallas-fuse", ",".join(p.resolve_fuse),
          "--buckets", str(buckets or p.buckets or PB_LRU_BUCKETS),
          "--churn", str(p.resolve_churn),
          "--steps", str(p.resolve_steps), "--segments", str(p.resolve_segments),
          "--warmup", "1"]
  return resolve.run(resolve._parser().parse_args(argv))


def run(p: PoliciesParams, ctx: Context) -> Outcome:
  sel = p.load()
  k = sel.top_k
  R = p.buckets or PB_LRU_BUCKETS
  big_b = max(p.batches)  # the ring sizes' batch (the hit rates)
  big = max(p.resolve_batches, default=0)  # the ring sizes' batch (the resolve times)
  hits, ring = {}, {}
  pool = lambda b: max(int(p.pool_factor * b * (k + 1)), b * (k + 1))
  with tempfile.TemporaryDirectory(prefix="ula-jax-policies-") as tmp:
    for b in p.batches:
      trace = build_trace(p, sel, tmp, requests=max(b, sel.num_requests), batch=b)
      hits[b] = {pol: replay_ula(trace, device_pool=pool(b), policy=pol, buckets=R)
                 for pol in ("pb_lru", "lru")}
      ctx.log(f"  batch {b}: hit rate pb_lru {hits[b]['pb_lru']['hit_rate']:.4f}, "
              f"lru {hits[b]['lru']['hit_rate']:.4f}")
      if b == big_b:
        for r in p.bucket_sweep:  # the largest batch's trace, every ring size
          ring[r] = (hits[b]["pb_lru"] if r == R else
                     replay_ula(trace, device_pool=pool(b), policy="pb_lru", buckets=r))
          ctx.log(f"  batch {b}, {r} buckets: hit rate pb_lru {ring[r]['hit_rate']:.4f}")
  res = resolve_times(p, k) if p.resolve_batches else {"rows": []}
  us = {}
  for r in res["rows"]:
    if r["us"] is not None:
      us.setdefault((r["batch"], r["impl"]), {})[r["policy"]] = r["us"]
  ring_us: dict[int, dict[str, float]] = {}  # buckets -> impl -> us (PB-LRU)
  ring_errors: list[str] = []
  if p.resolve_batches and p.resolve_bucket_sweep:
    for r in p.resolve_bucket_sweep:
      rr = res if r == R else resolve_times(p, k, batches=[big], policies="pb_lru",
                                            buckets=r)
      for row in rr["rows"]:
        if row["batch"] == big and row["policy"] == "pb_lru":
          if row["us"] is not None:
            ring_us.setdefault(r, {})[row["impl"]] = row["us"]
          elif row["error"] and not row["error"].startswith("skipped"):
            ring_errors.append(f"{r} buckets {row['impl']}: {row['error']}")
  rows = []
  for b, h in hits.items():
    pb, lru = h["pb_lru"], h["lru"]
    rows.append({"what": "hit rate", "batch": b, "buckets": R,
                 "device slots": pb["device_slots"],
                 "pb_lru": pb["hit_rate"], "lru": lru["hit_rate"],
                 "pb_lru - lru (pp)": 100 * (pb["hit_rate"] - lru["hit_rate"]),
                 "evictions pb_lru": pb["evictions"], "evictions lru": lru["evictions"]})
    rows.append({"what": "host model ms / step", "batch": b, "buckets": R,
                 "device slots": pb["device_slots"],
                 "pb_lru": 1e3 * pb["replay_s"] / pb["steps"],
                 "lru": 1e3 * lru["replay_s"] / lru["steps"],
                 "lru / pb_lru": lru["replay_s"] / pb["replay_s"] if pb["replay_s"] else None})
  for (b, impl), t in sorted(us.items()):
    rows.append({"what": f"resolve us ({impl})", "batch": b, "buckets": R,
                 "device slots": p.resolve_pool,
                 "pb_lru": t.get("pb_lru"), "lru": t.get("lru"),
                 "lru / pb_lru": (t["lru"] / t["pb_lru"] if "lru" in t and "pb_lru" in t
                                  else None)})
  lru_big = hits[big_b]["lru"]["hit_rate"]
  for r, h in sorted(ring.items()):
    rows.append({"what": "hit rate, ring size", "batch": big_b, "buckets": r,
                 "device slots": h["device_slots"], "pb_lru": h["hit_rate"], "lru": lru_big,
                 "pb_lru - lru (pp)": 100 * (h["hit_rate"] - lru_big),
                 "evictions pb_lru": h["evictions"],
                 "evictions lru": hits[big_b]["lru"]["evictions"]})
  for r, t in sorted(ring_us.items()):
    for impl, v in sorted(t.items()):
      rows.append({"what": f"resolve us ({impl}), ring size", "batch": big, "buckets": r,
                   "device slots": p.resolve_pool, "pb_lru": v,
                   "lru": us.get((big, impl), {}).get("lru")})
  gaps = [abs(r["pb_lru - lru (pp)"]) for r in rows if r["what"] == "hit rate"]
  # Each policy's fastest launch form at the largest batch (exact LRU's is four launches
  # under either form; PB-LRU's fastest is the one kernels.resolve=auto ranks first).
  at_big = [t for (b, _), t in us.items() if b == big]
  fastest = {pol: min((t[pol] for t in at_big if t.get(pol)), default=None)
             for pol in ("pb_lru", "lru")}
  speed = (fastest["lru"] / fastest["pb_lru"] if fastest["lru"] and fastest["pb_lru"]
           else None)
  anchor = [AnchorPoint("hit rate gap, PB-LRU vs LRU, pp (largest)", max(gaps), 0.1,
                        "UlaCache"),
            AnchorPoint("LRU / PB-LRU resolve time, largest batch, fastest forms", speed,
                        1.5, "UlaCache (1.5-2.3)")]
  errors = [f"{r['batch']} {r['policy']} {r['impl']}: {r['error']}" for r in res["rows"]
            if r["error"] and not r["error"].startswith("skipped")] + ring_errors
  checks = [
      Check("PB-LRU's hit rate within 2 pp of exact LRU's at every batch",
            max(gaps) <= 2.0, f"largest gap {max(gaps):.3f} pp"),
      Check("both policies saw the same lookups", all(
          h["pb_lru"]["hits"] + h["pb_lru"]["misses"] == h["lru"]["hits"] + h["lru"]["misses"]
          for h in hits.values()), "hits + misses equal per batch"),
      Check("the pool was tight: steps evicted", all(
          h["lru"]["evictions"] > 0 for h in hits.values()), "evictions at every batch"),
      Check("every ring size saw the same lookups", not ring or (all(
                h["hits"] + h["misses"] == hits[big_b]["lru"]["hits"]
                + hits[big_b]["lru"]["misses"] for h in ring.values())),
            f"{len(ring)} ring sizes" if ring else "none asked for (bucket_sweep)"),
      Check("every resolve measurement ran", not errors, "; ".join(errors) or
            f"{len(us)} (batch, impl) pairs" if us else "none asked for (resolve_batches)")]

  def draw(fig):
    ax1, ax2, ax4, ax3 = fig.subplots(1, 4, gridspec_kw={"width_ratios": [1, 1, 1, 1]})
    bs = list(hits)
    for pol, m in (("pb_lru", "o"), ("lru", "s")):
      ax1.plot(bs, [100 * hits[b][pol]["hit_rate"] for b in bs], marker=m, label=pol)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("decode rows (batch)")
    ax1.set_ylabel("hit rate (%)")
    ax1.set_title(f"trained-model selections, pool {p.pool_factor} x (k+1) per row",
                  fontsize="medium")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize="small")
    for impl in sorted({i for _, i in us}):
      pts = sorted((b, t) for (b, i), t in us.items() if i == impl)
      for pol, m in (("pb_lru", "o"), ("lru", "s")):
        ax2.plot([b for b, _ in pts], [t.get(pol) for _, t in pts], marker=m,
                 label=f"{pol} ({impl}, one group)")
    for pol, m in (("pb_lru", "o"), ("lru", "s")):
      ax2.plot(bs, [1e3 * hits[b][pol]["replay_s"] / hits[b][pol]["steps"] for b in bs],
               marker=m, ls=":", label=f"{pol} (host model, a step)")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("batch")
    ax2.set_ylabel("us per resolve (bench) / ms per step (host model)")
    ax2.set_title(f"resolve time; bench resolve pool {p.resolve_pool}, k {p.resolve_k or k}"
                  if us else "resolve time of the NumPy models", fontsize="medium")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize="small")
    if ring:
      rs = sorted(ring)
      ax4.plot(rs, [100 * (lru_big - ring[r]["hit_rate"]) for r in rs], marker="o",
               label=f"gap, batch {big_b}")
      ax4.axhline(0.1, color="gray", ls="--", label="anchor: 0.1 pp")
      ax4.set_xscale("log", base=2)
      ax4.set_xlabel("PB-LRU ring size (memory.pb_lru_buckets)")
      ax4.set_ylabel("PB-LRU's hit rate below exact LRU's (pp)")
      ax4.grid(True, alpha=0.3)
      if ring_us:
        tw = ax4.twinx()
        for impl in sorted({i for t in ring_us.values() for i in t}):
          pts = sorted((r, t[impl]) for r, t in ring_us.items() if impl in t)
          tw.plot([r for r, _ in pts], [v for _, v in pts], marker="s", ls=":", color="C3",
                  label=f"PB-LRU resolve us ({impl}), batch {big}")
        tw.set_ylabel("us per resolve (one group)")
        tw.legend(fontsize="small", loc="upper center")
      ax4.legend(fontsize="small")
      ax4.set_title("ring size: hit rate gap" + (" and resolve time" if ring_us else ""),
                    fontsize="medium")
    else:
      ax4.set_axis_off()
    anchor_panel(ax3, anchor)

  return Outcome(title="PB-LRU against exact LRU",
                 columns=["what", "batch", "buckets", "device slots", "pb_lru", "lru",
                          "pb_lru - lru (pp)", "lru / pb_lru", "evictions pb_lru",
                          "evictions lru"],
                 rows=rows, data={"hit_rates": hits, "resolve": res, "buckets": R,
                                  "ring_hit_rates": ring, "ring_resolve_us": ring_us,
                                  "selections": sel.source, "top_k": k},
                 checks=checks, anchor=anchor, draw=draw, figsize=(18, 4.8),
                 notes=[f"selections: {sel.num_requests} recorded requests x "
                        f"{sel.num_steps} decode steps, {sel.num_groups} layer groups, "
                        f"top-k {k}",
                        "host model ms / step: the NumPy models of ula's resolve (traces/"
                        "fast.py, the jax code's choices) replaying the selections, all groups",
                        *([f"resolve us: bench resolve (one layer group) on its own stream "
                           f"(churn {p.resolve_churn}), not the trained selections"] if us
                          else [])])


def devices(p: PoliciesParams) -> tuple[str, int]:
  return p.platform, 1


EXPERIMENT = Experiment(
    name="policies",
    question="Does PB-LRU keep exact LRU's hit rate on a trained model's selections, and "
    "how much faster is its resolve as the batch grows?",
    anchor="UlaCache: hit rate within 0.1 pp of exact LRU; scheduling 1.5-2.3x faster at "
    "large batch",
    params=PoliciesParams, run=run, devices=devices)
