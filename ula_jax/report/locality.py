"""Tables and PNG plots of a trace's locality statistics (``memory.traces.stats``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from ula_jax.report.tables import fmt

PLOT_FILES = ("locality_overlap.png", "locality_reuse.png", "locality_miss_rate.png")


def _rate(x: Any) -> str:
  return "-" if x is None else f"{x:.3f}"


def locality_tables(stats: dict[str, Any], title: str = "selection locality") -> list[Table]:
  """Per layer group, per context length, the per-request buffers against the shared
  pool at the same memory, and the reuse-distance histogram."""
  lru = stats["lru_buffer"]
  tables = []
  by_group = Table(title=f"{title}: per layer group")
  by_group.add_column("group", justify="right")
  by_group.add_column("overlap", justify="right")
  for key, v in lru.items():
    by_group.add_column(f"LRU {key} miss", justify="right")
  G = len(stats["overlap"]["per_group"])
  for g in range(G):
    by_group.add_row(str(g), _rate(stats["overlap"]["per_group"][g]),
                     *[_rate(v["per_group"][g]) for v in lru.values()])
  by_group.add_row("all", _rate(stats["overlap"]["mean"]),
                   *[_rate(v["miss_rate"]) for v in lru.values()], style="bold")
  tables.append(by_group)

  by_ctx = Table(title=f"{title}: per context length (tokens)")
  by_ctx.add_column("context", justify="right")
  by_ctx.add_column("overlap", justify="right")
  for key in lru:
    by_ctx.add_column(f"LRU {key} miss", justify="right")
  for label in stats["overlap"]["per_context"]:
    by_ctx.add_row(label, _rate(stats["overlap"]["per_context"][label]),
                   *[_rate(v["per_context"].get(label)) for v in lru.values()])
  tables.append(by_ctx)

  pool = stats.get("shared_pool")
  sizing = Table(title=f"{title}: miss rate at equal device memory")
  sizing.add_column("buffer")
  sizing.add_column("entries / request", justify="right")
  sizing.add_column("per-request LRU", justify="right")
  if pool:
    sizing.add_column("shared pool slots", justify="right")
    sizing.add_column("pool pb_lru", justify="right")
    sizing.add_column("pool lru", justify="right")
  for key, v in lru.items():
    row = [key, fmt(v["entries"]), _rate(v["miss_rate"])]
    if pool and key in pool:
      p = pool[key]
      row += [fmt(p["device_pool"]), _rate(p["pb_lru"]["miss_rate"]),
              _rate(p["lru"]["miss_rate"])]
    elif pool:
      row += ["-", "-", "-"]
    sizing.add_row(*row)
  tables.append(sizing)

  reuse = stats["reuse_distance"]
  hist = Table(title=f"{title}: reuse distance (decode steps; fraction of reuses)")
  total = sum(reuse["counts"]) or 1
  for label in reuse["bins"]:
    hist.add_column(label, justify="right")
  hist.add_column("first use (count)", justify="right")
  hist.add_row(*[f"{c / total:.3f}" for c in reuse["counts"]], fmt(reuse["first_use"]))
  tables.append(hist)
  return tables


def plot_locality(stats: dict[str, Any], out_dir: str | Path, title: str = "") -> list[Path]:
  """``PLOT_FILES`` in ``out_dir``: overlap per group and per context length; the
  reuse-distance histogram; the miss rate against the buffer size (per-request LRU, and
  the shared pool under pb_lru and lru when measured)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  paths = []

  def save(fig: Figure, name: str) -> None:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    paths.append(out / name)

  ov = stats["overlap"]
  fig = Figure(figsize=(10, 4))
  ax1, ax2 = fig.subplots(1, 2)
  per_group = [v if v is not None else 0.0 for v in ov["per_group"]]
  ax1.bar(range(len(per_group)), per_group, color="tab:blue")
  if ov["mean"] is not None:
    ax1.axhline(ov["mean"], ls="--", color="k", lw=0.8, label=f"mean {ov['mean']:.3f}")
    ax1.legend(loc="lower right", fontsize="small")
  ax1.set_xticks(range(len(per_group)), [str(g) for g in range(len(per_group))],
                 fontsize="small")
  ax1.set_xlabel("layer group")
  ax1.set_ylabel("|S_t & S_(t-1)| / |S_t|")
  ax1.set_ylim(0, 1)
  ax1.set_title(title or "consecutive-step overlap")
  labels = list(ov["per_context"])
  ax2.bar(range(len(labels)), [v or 0.0 for v in ov["per_context"].values()],
          color="tab:green")
  ax2.set_xticks(range(len(labels)), labels, rotation=30, fontsize="small")
  ax2.set_xlabel("context (tokens)")
  ax2.set_ylim(0, 1)
  ax2.set_title("overlap by context length")
  save(fig, PLOT_FILES[0])

  reuse = stats["reuse_distance"]
  fig = Figure(figsize=(8, 4))
  ax = fig.subplots()
  ax.bar(range(len(reuse["bins"])), reuse["counts"], color="tab:orange")
  ax.set_xticks(range(len(reuse["bins"])), reuse["bins"], rotation=30, fontsize="small")
  ax.set_yscale("log")
  ax.set_xlabel("reuse distance (decode steps since the entry was last used)")
  ax.set_ylabel("selections")
  ax.set_title(f"reuse distance (first uses of prompt entries: {reuse['first_use']:,})")
  save(fig, PLOT_FILES[1])

  lru = stats["lru_buffer"]
  fig = Figure(figsize=(7, 4.5))
  ax = fig.subplots()
  x = [v["entries"] for v in lru.values()]
  ax.plot(x, [v["miss_rate"] for v in lru.values()], "o-", color="tab:blue",
          label="per-request LRU buffer (HiSparse)")
  G = len(ov["per_group"])
  for g in range(G):
    ax.plot(x, [v["per_group"][g] for v in lru.values()], "-", color="tab:blue", lw=0.4,
            alpha=0.4)
  pool = stats.get("shared_pool")
  if pool:
    for policy, color in (("pb_lru", "tab:red"), ("lru", "tab:purple")):
      pts = [(lru[key]["entries"], p[policy]["miss_rate"]) for key, p in pool.items()
             if key in lru]
      ax.plot([a for a, _ in pts], [b for _, b in pts], "s--", color=color,
              label=f"shared ula pool, {policy} (same memory)")
  ax.set_xscale("log", base=2)
  ax.set_xticks(x, list(lru))
  ax.set_xlabel("entries per request and group (buffer size)")
  ax.set_ylabel("miss rate")
  ax.set_ylim(0, 1)
  ax.legend(fontsize="small")
  ax.set_title("miss rate against buffer size (thin lines: layer groups)")
  save(fig, PLOT_FILES[2])
  return paths
