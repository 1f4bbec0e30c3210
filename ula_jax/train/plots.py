"""``curves.png`` of a training run (matplotlib's Agg canvas; no global pyplot state)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def plot_curves(history: Sequence[dict], evals: Sequence[dict], unigram: float,
                path: str | Path, title: str = "") -> Path:
  """Three panels over steps: training and held-out loss (nats/token) with the unigram
  baseline; the indexer's KL (over every causal position in the dense stage, over the
  selected ones in the sparse stage); the share of attention its top-k captures, with
  the share the attention's own top-k holds. The stage boundary is a dotted line."""
  path = Path(path)
  fig = Figure(figsize=(8, 9))
  ax1, ax2, ax3 = fig.subplots(3, 1, sharex=True)
  steps = [r["step"] for r in history]
  ax1.plot(steps, [r["lm"] for r in history], lw=0.8, label="training loss")
  if evals:
    ev = [r["step"] for r in evals]
    ax1.plot(ev, [r["loss_sparse"] for r in evals], "o-", label="held-out, top-k attention")
    ax1.plot(ev, [r["loss_dense"] for r in evals], "s--", label="held-out, dense attention")
    ax3.plot(ev, [r["captured_mass"] for r in evals], "o-", label="all queries")
    if "captured_mass_beyond_k" in evals[0]:
      ax3.plot(ev, [r["captured_mass_beyond_k"] for r in evals], "s--",
               label="queries with more than k candidates")
      ax3.plot(ev, [r["attention_topk_mass_beyond_k"] for r in evals], ":", color="gray",
               label="the attention's own top-k there (the ceiling)")
  ax1.axhline(unigram, ls=":", color="gray", label=f"unigram baseline ({unigram:.2f})")
  ax1.set_ylabel("nats / token")
  ax1.set_title(title or "training")
  ax1.legend(fontsize="small")
  ax2.plot(steps, [r["kl"] for r in history], lw=0.8, color="tab:red")
  ax2.set_yscale("log")
  ax2.set_ylabel("indexer KL (nats)")
  ax3.set_ylabel("attention captured by top-k")
  ax3.set_xlabel("step")
  ax3.set_ylim(0, 1.02)
  ax3.legend(fontsize="small", loc="lower right")
  dense = [r["step"] for r in history if r["stage"] == "dense"]
  if dense and len(dense) < len(history):
    for ax in (ax1, ax2, ax3):
      ax.axvline(max(dense), ls=":", lw=0.8, color="black")
  FigureCanvasAgg(fig)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path
