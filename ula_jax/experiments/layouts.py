"""Layouts: ula TP's ``mod`` / ``block`` / ``request`` against the replicated baseline.

The trained model's selections (``experiments/traces``) on ``batch`` rows of one dp
rank of ``tp`` ranks, each with ``device_pool`` tokens of device memory:

* **cross-device bytes per decode step**: the trace replayed through ula's TP mode (its
  jax transitions, ``tp`` simulated devices) for every layout: the local buffer's misses
  delivered from their owner to the other ranks (``xdev_rows`` x row bytes) plus the
  indexer's all-gather (``xdev_index_bytes``). ``resident`` (replicated) moves none;
* **balance across ranks**: each layout's own code (``layouts.py``: ``place``,
  ``locate``, ``release``) walked over the trace's events: the entries each rank owns at
  the peak (storage), and per decode step the selected entries each rank owns (the rows
  it must deliver when they miss: the all-gather carries ``tp`` x the busiest rank's),
  as max / mean over ranks;
* **capacity**: tokens a dp rank holds (``num_logical``) and requests of ``context``
  tokens admitted at once (``bench.serving.capacity`` with the layout).

DESIGN.md section 4's ablation: ``mod`` spreads a request evenly, ``block`` puts
contiguous ranges on one rank, ``request`` one owner per request; replicated is
resident's full copy per rank (12.5% distinct at tp = 8).
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Literal

import numpy as np
from pydantic import Field

from ula_jax.experiments.base import AnchorPoint, Check, Context, Experiment, Outcome, anchor_panel
from ula_jax.experiments.policies import TraceParams, build_trace

LAYOUT_NAMES = ("mod", "block", "request")


class LayoutsParams(TraceParams):
  platform: Literal["cpu", "gpu"] = Field("cpu", description="devices the TP replay runs on")
  tp: int = Field(8, ge=2, description="tp ranks of the dp rank")
  batch: int = Field(4, ge=1, description="decode rows")
  requests: int | None = Field(None, ge=1, description="requests served; None = the "
                               "recorded ones, at least batch")
  layouts: list[Literal["mod", "block", "request", "replicated"]] = Field(
      default_factory=lambda: ["mod", "block", "request", "replicated"])
  device_pool: int | None = Field(
      None, ge=1, description="tokens of device memory per rank; None = the trace's whole "
      "history (the memory in which the replicated copy just holds it)")
  local_buffer: int | None = Field(None, ge=1, description="memory.local_buffer; None = "
                                   "one step's selections (batch x (k + 1))")
  context: int = Field(16384, ge=2, description="tokens per request for the capacity column")
  replay: list[Literal["mod", "block", "request"]] | None = Field(
      None, description="layouts replayed through ula's TP transitions; None = all. Every "
      "rank plans the same buffer hits and misses whatever the layout (tp.py, resolve), so "
      "a layout not replayed takes the first replayed one's counts")


def _system(p: LayoutsParams, trace, layout: str, device_pool: int):
  from ula_jax.config.schema import MemoryConfig
  from ula_jax.memory.traces.replay import build_rank_system

  B = trace.max_batch
  if layout == "replicated":
    cfg = MemoryConfig(system="resident", device_pool=device_pool)
  else:
    cfg = MemoryConfig(system="ula", device_pool=device_pool, host_pool=0, layout=layout,
                       local_buffer=p.local_buffer)
  return build_rank_system(cfg, trace.geometry(), tp=p.tp, max_batch=B,
                           page_size=trace.page_size,
                           max_context=max(trace.num_logical // B, 1))


def walk_owners(layout, trace, chunk: int = 16) -> dict:
  """Each rank's owned entries at the peak and, per decode step and layer group, the
  selected entries each rank owns, under ``layout`` (its own place / locate / release
  over the trace's events).

  A run of decode steps is taken ``chunk`` steps at a time: their new tokens are placed
  first, then their selections located at once (placing a page never moves one placed
  before, and nothing is released within the run), so every program has one shape."""
  import jax
  import jax.numpy as jnp

  from ula_jax.memory.traces.format import DECODE, PREFILL, RELEASE

  P = layout.tp
  place, release, locate = (jax.jit(f) for f in (layout.place, layout.release,
                                                  layout.locate))
  st = layout.init()
  live = np.zeros((trace.num_logical,), bool)
  owned_peak, peak_n = np.zeros((P,), np.int64), -1
  step_max, step_mean = [], []
  kind, ref, row = np.asarray(trace.kind), np.asarray(trace.ref), np.asarray(trace.row)
  width = 1 << max(int(np.asarray(trace.count).max(initial=1)) - 1, 0).bit_length()
  N = 1 << max(trace.num_logical - 1, 0).bit_length()
  G, B, k = trace.num_groups, trace.max_batch, trace.top_k

  def padded(a: np.ndarray, n: int) -> tuple:
    """``a`` in ``n`` slots (INVALID after it) and its valid mask."""
    out = np.full((n,), -1, np.int32)
    out[:a.shape[0]] = a
    return jnp.asarray(out), jnp.asarray(np.arange(n) < a.shape[0])

  def decode_run(ts: list[int]) -> None:
    nonlocal st
    n = len(ts)
    new = np.full((chunk, B), -1, np.int32)
    act = np.zeros((chunk, B), bool)
    sel = np.full((chunk, G, B, k), -1, np.int32)
    new[:n] = np.asarray(trace.new_addr[ts[0]:ts[-1] + 1])
    act[:n] = np.asarray(trace.active[ts[0]:ts[-1] + 1])
    ok = np.asarray(trace.sel_valid[ts[0]:ts[-1] + 1]) & (
        np.asarray(trace.sel_addr[ts[0]:ts[-1] + 1]) >= 0)
    sel[:n] = np.where(ok, np.asarray(trace.sel_addr[ts[0]:ts[-1] + 1]), -1)
    st = place(st, jnp.asarray(new.reshape(-1)), jnp.asarray(act.reshape(-1)),
               jnp.asarray(np.tile(np.arange(B, dtype=np.int32), chunk)))
    live[new[act]] = True
    rank = np.asarray(locate(st, jnp.asarray(sel))[0])[:n]  # [n, G, B, k]
    for t in range(n):
      for g in range(G):
        r = rank[t, g][ok[t, g]]
        if r.size:
          c = np.bincount(r[r >= 0], minlength=P)[:P]
          step_max.append(c.max())
          step_mean.append(c.mean())

  pending: list[int] = []
  for e in range(kind.shape[0]):
    if kind[e] == DECODE:
      pending.append(int(ref[e]))
      if len(pending) == chunk:
        decode_run(pending)
        pending = []
      continue
    if pending:
      decode_run(pending)
      pending = []
    a = trace.event_addrs(e).astype(np.int32)
    if kind[e] == PREFILL:
      st = place(st, *padded(a, width), jnp.full((width,), int(row[e]), jnp.int32))
      live[a] = True
    elif kind[e] == RELEASE:
      if live.sum() > peak_n:
        peak_n = int(live.sum())
        rank = np.asarray(locate(st, padded(np.flatnonzero(live).astype(np.int32), N)[0])[0])
        owned_peak = np.bincount(rank[rank >= 0], minlength=P)[:P]
      st = release(st, *padded(a, width), jnp.int32(int(row[e])))
      live[a] = False
  if pending:
    decode_run(pending)
  return {"owned_at_peak": owned_peak.tolist(),
          "storage_balance": float(owned_peak.max() / owned_peak.mean())
          if owned_peak.sum() else None,
          "selection_balance": float(np.sum(step_max) / np.sum(step_mean))
          if step_mean else None}


def run(p: LayoutsParams, ctx: Context) -> Outcome:
  from ula_jax.bench.serving import Setup, capacity

  from ula_jax.experiments.common import BASE_CONFIG
  from ula_jax.memory.traces.replay import replay

  sel = p.load()
  k, n = sel.top_k, p.requests or max(p.batch, sel.num_requests)
  out: dict[str, dict] = {}
  counted: dict = {}  # the first replayed layout's buffer counts
  with tempfile.TemporaryDirectory(prefix="ula-jax-layouts-") as tmp:
    trace = build_trace(p, sel, tmp, requests=n, batch=p.batch)
    L = p.local_buffer or p.batch * (k + 1)
    # Default: the memory in which the replicated copy just holds the trace's history.
    dev = p.device_pool or -(-trace.num_logical // p.page_size) * p.page_size
    row_bytes = trace.geometry().row_bytes
    for layout in p.layouts:
      # The replicated copy holds 1/tp of the history the same memory holds under a
      # layout: its replay gets the pool the trace needs, its capacity the same memory.
      pool = (max(dev, -(-trace.num_logical // p.page_size) * p.page_size)
              if layout == "replicated" else dev)
      system = _system(p, trace, layout, pool)
      replayed = layout == "replicated" or p.replay is None or layout in p.replay
      if replayed:
        r = replay(trace, system, engine="fast" if layout == "replicated" else "system",
                   report_every=1, validate=False)
        tot, rep = r.totals(), r.peak_report()
        seconds, compile_s = r.seconds, r.compile_seconds
        if layout != "replicated":
          counted.setdefault("from", layout)
          counted.setdefault("totals", tot)
      else:
        first = next(x for x in p.layouts if x in (p.replay or ()))
        if first not in out:
          raise ValueError(f"layouts={p.layouts}, replay={p.replay}: a replayed layout must "
                           f"come before {layout!r} in layouts")
        tot, seconds, compile_s = counted["totals"], 0.0, 0.0
        rep = None
      steps = max(trace.num_steps, 1)
      xdev = (tot.get("xdev_rows", 0) * row_bytes + tot.get("xdev_index_bytes", 0)) / steps
      entry = {"tokens_per_rank": dev if layout == "replicated" else system.num_logical,
               "device_pool": dev, "replayed": replayed,
               "hits": tot.get("hits"), "misses": tot.get("misses"),
               "xdev_bytes_per_step": xdev,
               "distinct_fraction": rep.distinct_fraction if rep is not None else None,
               "replay_s": seconds, "compile_s": compile_s,
               "pool_used": rep.extra.get("pool_used") if rep is not None else None}
      if layout == "replicated":
        entry.update(storage_balance=1.0, selection_balance=1.0,
                     owned_at_peak=[int(rep.distinct_total)] * p.tp)
      else:
        entry.update(walk_owners(system.layout, trace))
      args = argparse.Namespace(config=BASE_CONFIG, context=p.context, max_rows=256,
                                overrides=_cap_overrides(p, sel))
      mem = (["memory.system=resident"] if layout == "replicated" else
             ["memory.system=ula", f"memory.layout={layout}", "memory.host_pool=0"])
      s = Setup(layout, 1, p.tp, tuple(["mesh.dp=1", f"mesh.tp={p.tp}",
                                        f"memory.device_pool={dev}"] + mem))
      entry["capacity"] = capacity(args, s)
      out[layout] = entry
      ctx.log(f"  {layout}: {xdev / 1e6:.2f} MB cross-device per step, storage balance "
              f"{entry['storage_balance']}, {entry['capacity']['requests']} requests of "
              f"{p.context}")
  rows = [{"layout": name + ("" if e["replayed"] else " *"), "cross-device MB / step": e["xdev_bytes_per_step"] / 1e6,
           "buffer hit rate": (e["hits"] / (e["hits"] + e["misses"])
                               if e.get("hits") is not None and e["hits"] + e["misses"]
                               else None),
           "storage max / mean": e["storage_balance"],
           "selection max / mean": e["selection_balance"],
           "tokens / dp rank": e["tokens_per_rank"],
           f"requests of {p.context}": e["capacity"]["requests"],
           "distinct fraction": e["distinct_fraction"]} for name, e in out.items()]
  checks = []
  ula = [x for x in out if x != "replicated"]
  if "replicated" in out:
    f = out["replicated"]["distinct_fraction"]
    checks.append(Check(f"replicated stores 1/{p.tp} distinct", abs(f - 1 / p.tp) < 1e-12,
                        f"distinct fraction {f}"))
  replayed = [x for x in ula if out[x]["replayed"]]
  if len(replayed) > 1:
    same = len({(out[x]["hits"], out[x]["misses"]) for x in replayed}) == 1
    checks.append(Check("the local buffer's hits and misses do not depend on the layout",
                        same, ", ".join(f"{x}: {out[x]['hits']}/{out[x]['misses']}"
                                        for x in replayed)))
  if "mod" in out:
    b = out["mod"]["storage_balance"]
    checks.append(Check("mod spreads the stored history evenly (max/mean <= 1.01)",
                        b is not None and b <= 1.01, f"max / mean {b}"))
  for x in ula:
    if "replicated" in out:
      more = out[x]["tokens_per_rank"] > out["replicated"]["tokens_per_rank"]
      checks.append(Check(f"{x} holds more history than replicated", more,
                          f"{out[x]['tokens_per_rank']} vs "
                          f"{out['replicated']['tokens_per_rank']} tokens"))
  anchor = []
  if "replicated" in out:
    anchor.append(AnchorPoint(f"replicated TP{p.tp} distinct fraction",
                              out["replicated"]["distinct_fraction"], 0.125, "UlaCache"))
  if "mod" in out and "replicated" in out:
    anchor.append(AnchorPoint("mod / replicated tokens per dp rank",
                              out["mod"]["tokens_per_rank"] / out["replicated"]["tokens_per_rank"],
                              float(p.tp), "UlaCache (t mod P)"))

  def draw(fig):
    ax1, ax2, ax3 = fig.subplots(1, 3)
    names = list(out)
    ax1.bar(names, [out[x]["xdev_bytes_per_step"] / 1e6 for x in names], color="tab:blue")
    ax1.set_ylabel("cross-device MB per decode step")
    ax1.set_title(f"tp {p.tp}, {n} requests on {p.batch} rows", fontsize="medium")
    w = 0.38
    xs = np.arange(len(names))
    ax2.bar(xs - w / 2, [out[x]["storage_balance"] or 0 for x in names], w,
            label="stored entries")
    ax2.bar(xs + w / 2, [out[x]["selection_balance"] or 0 for x in names], w,
            label="selected entries per step")
    ax2.axhline(1.0, color="gray", lw=1, ls="--")
    ax2.set_xticks(xs, names)
    ax2.set_ylabel("busiest rank / mean rank")
    ax2.set_title("balance across tp ranks", fontsize="medium")
    ax2.legend(fontsize="small")
    anchor_panel(ax3, anchor)

  return Outcome(title=f"ula TP layouts over {p.tp} ranks, trained-model selections",
                 columns=["layout", "cross-device MB / step", "buffer hit rate",
                          "storage max / mean", "selection max / mean", "tokens / dp rank",
                          f"requests of {p.context}", "distinct fraction"],
                 rows=rows, data={"layouts": out, "top_k": k, "requests": n,
                                  "selections": sel.source},
                 checks=checks, anchor=anchor, draw=draw,
                 notes=[f"device memory {dev} tokens per rank, local buffer {L}",
                        *([f"replayed through ula's TP transitions: {', '.join(replayed)}; "
                           f"the others take {counted.get('from')}'s buffer counts (the same "
                           f"on every layout)"] if len(replayed) < len(ula) else []),
                        "the all-gather of a step's misses carries tp x the busiest rank's "
                        "rows: selection max / mean is that padding, to first order"])


def _cap_overrides(p: LayoutsParams, sel) -> list[str]:
  from ula_jax.experiments.base import cache_overrides
  """The selections' KV geometry for the capacity column (no model runs)."""
  return ["model=small", f"model.num_layers={sel.num_layers}",
          f"model.num_dense_layers={sel.num_layers}", f"model.index_share={sel.group_size}",
          f"model.index_topk={sel.top_k}", f"model.num_heads={p.tp}",
          f"engine.page_size={p.page_size}", "mesh.platform=cpu", *cache_overrides()]


def devices(p: LayoutsParams) -> tuple[str, int]:
  return p.platform, p.tp


EXPERIMENT = Experiment(
    name="layouts",
    question="Where should a request's entries live across the tp ranks (mod, block or "
    "request, against the replicated copy): which moves fewer bytes across devices, holds "
    "more and keeps the ranks even?",
    anchor="UlaCache: position t of a request on rank t mod P stores distinct history "
    "(replicated: 12.5% distinct at TP8)",
    params=LayoutsParams, run=run, devices=devices)
