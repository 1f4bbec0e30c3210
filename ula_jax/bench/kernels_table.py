"""The table of ``kernels.*: auto`` (``ula_jax/kernels/auto_table.json``), built from the
JSON of the kernel benchmarks.

    ula-jax bench kernels_table [--out PATH] [--merge TABLE] FILE_OR_FOLDER ...

Reads runs of ``ula-jax bench attention``, ``fetch``, ``resolve`` and ``prefill`` (files,
or folders searched for ``*.json``; a file may hold several runs as sections) and writes,
per GPU (a run's ``environment.device``; runs on other backends are skipped), each
operation's implementations ranked by measured time, fastest first:

* a row counts for an implementation when it measured the launch the config value runs:
  attention ``xla``, ``pallas`` / ``pallas[auto]``, ``mosaic`` / ``mosaic[auto]``; fetch
  ``xla``, ``ffi``, ``pallas`` / ``pallas[u1024,w4]`` (``CopyRowsConfig()``); resolve
  ``jnp`` and ``pallas`` / ``pallas[fused]``, as ``pallas_fused`` where the row ran fused
  (and, where a row records its launch, only ``ResolveConfig()`` and ``FUSED_CONFIG``);
  the indexer: a prefill run's layer-group selection under its ``kernels.indexer``. Other
  labels are sweep points and are skipped. A sweep of one launch labels it with the bare
  name, so pass runs of the production launches only (the command below lists them for
  the H200);
* rows are compared only with rows of the same settings: attention the geometry (heads,
  top-k, latent, rope, dtype, row layout) and batch; fetch the direction, row layout and entries per
  call; resolve the policy, pool, batch, top-k and the stream's loop, steps, cache
  flush and PB-LRU ring size; the indexer the model's indexer, the chunk and the prefix.
  Of several runs of one implementation there the latest (``environment.date``) counts:
  kernels change;
* attention: per geometry, one row range per measured batch (from it to the next one's),
  ranking the implementations measured at that batch;
* indexer, fetch and each resolve policy: one ranking, by the geometric mean over the
  compared settings of each implementation's time over the fastest one's there (an
  implementation never compared with another comes last); fetch and resolve also one
  such ranking per launch shape measured (``by_shape``): fetch per row size and rows per
  call (both directions), resolve per batch and, for PB-LRU, ring size (every pool
  measured there).

``--merge TABLE`` keeps the devices of an existing table that the inputs do not measure.
Prints the rankings and writes the table, checked by ``kernels.auto.check_table``. The
shipped table (the H200's rows and the H100 80GB's; ``benchmarks/probes/gpu_auto_table.sh``
measures a GPU's)::

    ula-jax bench kernels_table --out ula_jax/kernels/auto_table.json \\
        results/h200/bench_attention.json results/h200/bench_attention_auto.json \\
        results/h200/bench_attention_mosaic_issuers.json results/h200/bench_fetch.json \\
        results/h200/bench_resolve.json results/h200/bench_resolve_fused.json \\
        results/h200/prefill/prefill.json \\
        results/h200/decode_ratios/fifth_run/resolve_r4.json \\
        results/h200/decode_ratios/fifth_run/resolve_r32.json \\
        results/h200/decode_ratios/sixth_run/fetch.json \\
        results/h100/auto_table/attention.json results/h100/auto_table/attention_large.json \\
        results/h100/auto_table/fetch.json results/h100/auto_table/resolve_r32.json \\
        results/h100/auto_table/resolve_r4.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterator

from ula_jax.kernels import auto

DEFAULT_OUT = "runs/bench/auto_table.json"
COMMAND = "ula-jax bench kernels_table"
SELECTION = "selection (one group)"  # the prefill phase that times kernels.indexer


@dataclasses.dataclass(frozen=True)
class Measurement:
  """One implementation's time at one setting, from one run."""

  device: str
  op: str
  group: tuple  # the settings measurements are compared within
  impl: str
  seconds: float
  date: str
  source: str


def _files(paths: list[str]) -> list[Path]:
  out = []
  for p in map(Path, paths):
    if p.is_dir():
      out += sorted(p.rglob("*.json"))
    elif p.is_file():
      out.append(p)
    else:
      raise ValueError(f"{p}: no such file or folder")
  return out


def _runs(doc: Any) -> Iterator[dict]:
  """The runs in a JSON document: the document itself, or its sections at any depth."""
  if not isinstance(doc, dict):
    return
  if "environment" in doc and ("benchmark" in doc or "phases" in doc):
    yield doc
    return
  for value in doc.values():
    yield from _runs(value)


def _production_labels() -> dict[str, dict[str, str]]:
  """Row label -> implementation, per benchmark, for the launches the config values run."""
  from ula_jax.kernels.fetch.pallas import CopyRowsConfig

  c = CopyRowsConfig()
  return {"attention": {"xla": "xla", "pallas": "pallas", "pallas[auto]": "pallas",
                        "mosaic": "mosaic", "mosaic[auto]": "mosaic"},
          "fetch": {"xla": "xla", "ffi": "ffi", "pallas": "pallas",
                    f"pallas[u{c.block_units},w{c.num_warps}]": "pallas"},
          "resolve": {"jnp": "jnp", "pallas": "pallas", "pallas[fused]": "pallas"}}


def _resolve_launches() -> dict[str, dict]:
  from ula_jax.memory.ula.resolve.pallas import FUSED_CONFIG, ResolveConfig

  return {"pallas": dataclasses.asdict(ResolveConfig()),
          "pallas_fused": dataclasses.asdict(FUSED_CONFIG)}


def measurements(run: dict, source: str) -> list[Measurement]:
  """The rows of one benchmark run that count (module docstring)."""
  env = run.get("environment") or {}
  if env.get("backend") not in auto.GPU_BACKENDS:
    return []
  device, date = env.get("device", ""), env.get("date", "")
  out = []

  def add(op: str, group: tuple, impl: str, seconds: Any) -> None:
    if isinstance(seconds, (int, float)) and seconds > 0:
      out.append(Measurement(device, op, group, impl, float(seconds), date, source))

  bench = run.get("benchmark")
  if bench == "attention":
    g = run["geometry"]
    geo = (g["heads"], g["k"], g["latent"], g["rope"], g["dtype"], g.get("kv_layout", "bf16"))
    labels = _production_labels()["attention"]
    for r in run["rows"]:
      if r["impl"] in labels and not r.get("error"):
        add("attention", geo + (r["batch"],), labels[r["impl"]], r.get("seconds"))
  elif bench == "fetch":
    labels = _production_labels()["fetch"]
    for r in run["rows"]:
      if r["impl"] in labels and not r.get("error") and r.get("ok") is not False:
        add("fetch", (r["direction"], r["layout"], r["entries"], r.get("row_bytes")),
            labels[r["impl"]], r.get("seconds"))
  elif bench == "resolve":
    labels, launches = _production_labels()["resolve"], _resolve_launches()
    s = run.get("stream") or {}
    for r in run["rows"]:
      if r["impl"] not in labels or r.get("error") or r.get("us") is None:
        continue
      impl = "pallas_fused" if r["impl"] != "jnp" and r.get("fused") else labels[r["impl"]]
      if r.get("config") is not None and r["config"] != launches.get(impl):
        continue
      group = (r["policy"], r["pool"], r["batch"], r.get("k", s.get("k")),
               s.get("loop") or "while", s.get("steps"), s.get("flush_mb") or 0,
               s.get("buckets"))
      add("resolve", group, impl, r["us"] * 1e-6)
  elif "phases" in run:
    m, ph = run.get("model") or {}, run["phases"]
    row = (ph.get("rows") or {}).get(SELECTION) or {}
    impl = row.get("impl") or (run.get("kernels") or {}).get("indexer")
    if impl in auto.IMPLS["indexer"]:
      group = (m.get("index_n_heads"), m.get("index_head_dim"), m.get("index_topk"),
               ph.get("chunk"), ph.get("prefix"))
      add("indexer", group, impl, row.get("seconds"))
  return out


def latest(ms: list[Measurement]) -> dict[tuple, Measurement]:
  """(device, op, group, impl) -> the measurement of the latest run there (of one run's
  repeats, the fastest)."""
  out: dict[tuple, Measurement] = {}
  for m in ms:
    key = (m.device, m.op, m.group, m.impl)
    old = out.get(key)
    if old is None or (m.date, -m.seconds) > (old.date, -old.seconds):
      out[key] = m
  return out


def _sig(x: float) -> float:
  return float(f"{x:.4g}")


def _cite(m: Measurement) -> str:
  return f"{m.source} ({m.date[:10]})"


def attention_entries(found: dict[tuple, Measurement], device: str) -> list[dict]:
  """A device's attention entries: per geometry, a row range per measured batch."""
  by_geo: dict[tuple, dict[int, dict[str, Measurement]]] = collections.defaultdict(
      lambda: collections.defaultdict(dict))
  for (dev, op, group, impl), m in found.items():
    if dev == device and op == "attention":
      by_geo[group[:6]][group[6]][impl] = m
  entries = []
  for (heads, k, latent, rope, dtype, layout), batches in sorted(by_geo.items()):
    order = sorted(batches)
    rows = []
    for i, b in enumerate(order):
      ms = sorted(batches[b].values(), key=lambda m: m.seconds)
      rows.append({"min": 1 if i == 0 else b,
                   "max": order[i + 1] - 1 if i + 1 < len(order) else None,
                   "batch": b, "ranking": [m.impl for m in ms],
                   "seconds": {m.impl: _sig(m.seconds) for m in ms},
                   "sources": {m.impl: _cite(m) for m in ms}})
    geometry = {"heads": heads, "latent": latent, "rope": rope, "top_k": k, "dtype": dtype}
    if layout != "bf16":  # rows of values: the key is left out, as in tables before it
      geometry["kv_layout"] = layout
    entries.append({"geometry": geometry, "rows": rows})
  return entries


def ranked(found: dict[tuple, Measurement], device: str, op: str,
           keep: Any = lambda group: True) -> dict | None:
  """One ranking of ``op`` on ``device`` over the settings ``keep`` accepts (module
  docstring); None when nothing was measured."""
  groups: dict[tuple, dict[str, Measurement]] = collections.defaultdict(dict)
  for (dev, o, group, impl), m in found.items():
    if dev == device and o == op and keep(group):
      groups[group][impl] = m
  if not groups:
    return None
  logs: dict[str, list[float]] = collections.defaultdict(list)
  for ms in groups.values():
    if len(ms) > 1:
      best = min(m.seconds for m in ms.values())
      for impl, m in ms.items():
        logs[impl].append(math.log(m.seconds / best))
  relative = {impl: round(math.exp(sum(v) / len(v)), 4) for impl, v in logs.items()}
  alone = sorted({impl for ms in groups.values() for impl in ms} - set(relative))
  ranking = sorted(relative, key=lambda i: (relative[i], i)) + alone
  # The runs the ranking rests on: the compared settings', and those of an implementation
  # measured alone.
  used = {m for ms in groups.values() for impl, m in ms.items()
          if len(ms) > 1 or impl in alone}
  return {"ranking": ranking, "relative": relative,
          "settings_compared": sum(len(ms) > 1 for ms in groups.values()),
          "sources": sorted({_cite(m) for m in used})}


# Per operation: the launch shape of a compared setting (its group), as the table's
# ``by_shape`` entries name it. Fetch: the row size and rows per call; resolve: PB-LRU's
# ring (where the run recorded it) and the batch, exact LRU's batch.
SHAPES: dict[str, Any] = {
    "fetch": lambda g: None if g[3] is None else {"row_bytes": g[3], "entries": g[2]},
    "resolve": lambda g: ({"buckets": g[7], "batch": g[2]} if g[0] == "pb_lru" and g[7]
                          else {"batch": g[2]}),
}


def by_shape(found: dict[tuple, Measurement], device: str, op: str,
             keep: Any = lambda group: True) -> list[dict]:
  """``op``'s ranking at each launch shape measured on ``device`` (``SHAPES``), over the
  settings ``keep`` accepts: one ``ranked`` entry per shape, where more than one
  implementation was compared there."""
  shape_of = SHAPES[op]
  shapes = {tuple(shape_of(g).items()) for (dev, o, g, _) in found
            if dev == device and o == op and keep(g) and shape_of(g) is not None}
  out = []
  for items in sorted(shapes, key=lambda t: tuple(v for _, v in t)):
    shape = dict(items)
    entry = ranked(found, device, op, lambda g: keep(g) and shape_of(g) == shape)
    if entry and entry["settings_compared"]:
      out.append({**shape, **entry})
  return out


def build(paths: list[str], merge: dict | None = None) -> dict:
  """The table from the benchmark JSON in ``paths`` (files or folders); ``merge``: a table
  whose devices the inputs do not measure are kept."""
  ms = []
  for f in _files(paths):
    try:
      doc = json.loads(f.read_text())
    except ValueError as e:
      raise ValueError(f"{f}: not JSON ({e})") from None
    for run in _runs(doc):
      ms += measurements(run, str(f))
  found = latest(ms)
  devices: dict[str, dict] = {}
  for device in sorted({m.device for m in found.values()}):
    ops: dict[str, Any] = {}
    attention = attention_entries(found, device)
    if attention:
      ops["attention"] = attention
    for op in ("indexer", "fetch"):
      entry = ranked(found, device, op)
      if entry:
        ops[op] = entry
    if "fetch" in ops:
      ops["fetch"]["by_shape"] = by_shape(found, device, "fetch")
    resolve = {}
    for p in auto.POLICIES:
      entry = ranked(found, device, "resolve", lambda g, p=p: g[0] == p)
      if entry:
        resolve[p] = {**entry,
                      "by_shape": by_shape(found, device, "resolve", lambda g, p=p: g[0] == p)}
    if resolve:
      ops["resolve"] = resolve
    devices[device] = ops
  if merge:
    devices = {**{k: v for k, v in merge["devices"].items() if k not in devices}, **devices}
  return {"format": auto.TABLE_FORMAT,
          "about": ("kernels.*=auto: per GPU (device_kind) and operation, the implementations "
                    "measured, fastest first (ula_jax.kernels.auto); built by "
                    f"'{COMMAND}' from the benchmark runs named in each entry's sources"),
          "devices": dict(sorted(devices.items()))}


def print_rankings(table: dict) -> None:
  from ula_jax.bench.common import print_table

  cells = []
  for device, ops in table["devices"].items():
    for geo in ops.get("attention", []):
      g = geo["geometry"]
      shape = f"{g['heads']} heads, {g['latent']}+{g['rope']}, k {g['top_k']}"
      if g.get("kv_layout", "bf16") != "bf16":
        shape += f", {g['kv_layout']} rows"
      for row in geo["rows"]:
        rows = f"{row['min']}-{row['max'] if row['max'] is not None else ''}"
        cells.append([device, "attention", f"{shape}, rows {rows}", " > ".join(row["ranking"])])
    for op in ("indexer", "fetch"):
      if op in ops:
        cells.append([device, op, "", " > ".join(ops[op]["ranking"])])
      for e in (ops.get(op) or {}).get("by_shape", []):
        cells.append([device, op, f"{e['row_bytes']}-B rows, {e['entries']} a call",
                      " > ".join(e["ranking"])])
    for policy, entry in (ops.get("resolve") or {}).items():
      cells.append([device, "resolve", policy, " > ".join(entry["ranking"])])
      for e in entry.get("by_shape", []):
        ring = f", ring of {e['buckets']}" if "buckets" in e else ""
        cells.append([device, "resolve", f"{policy}{ring}, batch {e['batch']}",
                      " > ".join(e["ranking"])])
  print_table("kernels.*=auto: fastest first", ("device", "operation", "where", "ranking"),
              cells, left=("device", "operation", "where", "ranking"))


def main(argv: list[str]) -> int:
  """Builds and writes the table; returns 0."""
  p = argparse.ArgumentParser(prog=f"{COMMAND}", description=__doc__.split("\n\n")[0])
  p.add_argument("inputs", nargs="+", help="benchmark JSON files or folders of them")
  p.add_argument("--out", default=DEFAULT_OUT, help="the table to write")
  p.add_argument("--merge", default=None, metavar="TABLE",
                 help="keep this table's devices that the inputs do not measure")
  args = p.parse_args(argv)
  merge = auto.read_table(args.merge) if args.merge else None
  table = build(args.inputs, merge)
  problems = auto.check_table(table)
  if problems:
    raise ValueError("; ".join(problems))
  if not table["devices"]:
    raise ValueError(f"{' '.join(args.inputs)}: no GPU runs of the kernel benchmarks")
  print_rankings(table)
  out = Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(table, indent=1) + "\n")
  print(f"wrote {out}")
  return 0
