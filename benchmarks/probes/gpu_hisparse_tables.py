"""Do ``hisparse``'s mapping tables stay consistent through a whole run? The summarisation
experiment (any config with ``--config``) served as ``ula-jax run`` serves it, with every
table update checked inside its program.

The tables are two maps that must invert each other per layer group: ``slot_of[g, a] = s``
exactly when ``slot_addr[g, s] = a``. After every prefill chunk (the buffer warm-up) and
every release the probe counts, per group, slots whose address does not map back to them
and addresses whose slot does not hold them; before and after every resolve it does the
same for the resolved group, and counts the selected entries whose resolved slot holds
another address. Each check reports through a host callback with the group's clock (every
resolve and prefill chunk of the group advances it), so the first inconsistency and the
call that made it are named. The host callbacks change the compiled programs around
the model, so token comparisons of this run are weaker than a plain run's.

    python benchmarks/probes/gpu_hisparse_tables.py --json OUT.json [a.b=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

CONFIG = "experiments/glm5_summarization/config.yaml"


def main(argv: list[str]) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*")
  p.add_argument("--config", default=CONFIG)
  p.add_argument("--json", default="hisparse_tables.json")
  p.add_argument("--out", default=None,
                 help="keep the run directory here (default: a temporary one)")
  p.add_argument("--stop-after", type=int, default=200,
                 help="end the run this many checked calls after the first inconsistent "
                      "one (0: serve the whole workload)")
  args = p.parse_intermixed_args(argv)

  import numpy as np

  from ula_jax.bench.common import environment
  from ula_jax.config import load_config
  from ula_jax.report.output import RunInterrupted
  from ula_jax.run import run_experiment

  # mesh.platform=auto keeps jax's CPU backend beside the GPU: the checks report through
  # host callbacks, which need it.
  cfg = load_config(args.config, ["memory=hisparse", "engine.progress=false",
                                  "mesh.platform=auto"] + args.overrides)
  events: list[dict] = []
  counts = {"resolve": 0, "prefill": 0, "release": 0}
  t0 = time.time()

  def write(tokens=None) -> list:
    bad = sorted(events, key=lambda e: (max(np.ravel(e["clock"])), e["kind"]))
    out = {"environment": environment(), "overrides": args.overrides, "calls": counts,
           "seconds": round(time.time() - t0, 1), "inconsistent": bad[:200],
           "inconsistent_calls": len(bad), "finished": tokens is not None, "tokens": tokens}
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
    return bad

  def stop() -> None:  # from a callback: the findings are in, the rest of the run is not
    bad = write()
    print(f"stopped {args.stop_after} calls after the first inconsistency; checked {counts}; "
          f"{len(bad)} call(s) left inconsistent tables")
    for e in bad[:20]:
      print("  " + json.dumps(e))
    sys.stdout.flush()
    os._exit(3)

  watch_tables(events, counts, stop_after=args.stop_after, stop=stop)
  with tempfile.TemporaryDirectory() as d:
    try:
      result, run_dir = run_experiment(cfg, args.out or f"{d}/run", progress=False)
    except RunInterrupted as e:  # a time limit (SIGTERM): keep what was found so far
      bad = write()
      print(f"stopped by {e.signal_name}; checked {counts}; {len(bad)} call(s) left "
            "inconsistent tables")
      return 124
    tokens = {r.id: list(r.output_tokens) for r in result.requests}
  bad = write(tokens)
  print(f"checked {counts}; {len(bad)} call(s) left inconsistent tables")
  for e in bad[:20]:
    print("  " + json.dumps(e))
  return 0


def _consistency(slot_addr, slot_of):
  """One group's tables (slot_addr [S], slot_of [N]): (slots whose address does not map
  back, addresses whose slot does not hold them, the first such slot, its address, what
  that address maps to, the first such address, its slot, what that slot holds)."""
  import jax.numpy as jnp

  S, N = slot_addr.shape[0], slot_of.shape[0]
  back = slot_of[jnp.clip(slot_addr, 0, N - 1)]
  bad_s = (slot_addr >= 0) & (back != jnp.arange(S))
  held = slot_addr[jnp.clip(slot_of, 0, S - 1)]
  bad_a = (slot_of >= 0) & (held != jnp.arange(N))
  s0 = jnp.argmax(bad_s)
  a0 = jnp.argmax(bad_a)
  return jnp.stack([bad_s.sum(), bad_a.sum(), s0, slot_addr[s0], back[s0], a0, slot_of[a0],
                    held[a0]]).astype(jnp.int32)


_FIELDS = ("bad_slots", "bad_addresses", "slot", "slot_addr", "maps_to", "address",
           "address_slot", "slot_holds")


def watch_tables(events: list, counts: dict, stop_after: int = 0, stop=None) -> None:
  """Wraps HiSparse.resolve_rows, write_prefill and release with consistency checks;
  calls ``stop`` ``stop_after`` checked calls after the first inconsistent one."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from ula_jax.memory.hisparse import HiSparse

  since = []  # checked calls since the first inconsistent one

  def report(kind, clock, group, before, after, extra):
    counts[kind] += 1
    if events:
      since.append(kind)
      if stop_after and len(since) >= stop_after:
        stop()
    before, after = np.asarray(before), np.asarray(after)
    if before[..., :2].any() or after[..., :2].any() or int(extra) > 0:
      e = {"kind": kind, "clock": np.asarray(clock).tolist(),
           "group": np.asarray(group).tolist(), "selected_wrong": int(extra)}
      for name, arr in (("before", before), ("after", after)):
        rows = arr.reshape(-1, len(_FIELDS))
        e[name] = [dict(zip(_FIELDS, r.tolist()), group=i) for i, r in enumerate(rows)
                   if r[:2].any()] if rows.shape[0] > 1 else dict(zip(_FIELDS, rows[0].tolist()))
      events.append(e)

  def all_groups(st):
    return jax.vmap(_consistency)(st.slot_addr, st.slot_of)

  resolve_rows = HiSparse.resolve_rows

  def checked_resolve(self, state, group, sel_addr, sel_valid, new_addr, active):
    st, res = resolve_rows(self, state, group, sel_addr, sel_valid, new_addr, active)
    g = group
    before = _consistency(state.slot_addr[g], state.slot_of[g])
    after = _consistency(st.slot_addr[g], st.slot_of[g])
    ok = res.valid & (sel_addr >= 0) & (res.slots >= 0)
    holds = st.slot_addr[g, jnp.maximum(res.slots, 0)]
    wrong = (ok & (holds != sel_addr)).sum()
    jax.debug.callback(lambda c, gg, b, a, w: report("resolve", c, gg, b, a, w),
                       st.clock[g], jnp.asarray(g, jnp.int32), before, after, wrong)
    return st, res

  write_prefill = HiSparse.write_prefill

  def checked_prefill(self, state, addrs, valid, entries, row):
    st = write_prefill(self, state, addrs, valid, entries, row)
    jax.debug.callback(lambda c, b, a: report("prefill", c, -1, b, a, 0),
                       st.clock, all_groups(state), all_groups(st))
    return st

  release = HiSparse.release

  def checked_release(self, state, addrs, valid, row):
    st = release(self, state, addrs, valid, row)
    jax.debug.callback(lambda c, b, a: report("release", c, -1, b, a, 0),
                       st.clock, all_groups(state), all_groups(st))
    return st

  HiSparse.resolve_rows = checked_resolve
  HiSparse.write_prefill = checked_prefill
  HiSparse.release = checked_release


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
