"""The operations of a compiled decode step, by kind: what a step launches.

    python benchmarks/probes/decode_hlo_ops.py [--batch 8] [--context 1152] [--out DIR] \
        [--systems resident,ula] [a.b=value ...]

For each memory system (``ula`` runs with the config's ``kernels.fast_path_mode``), the
engine's decode step (``speculate`` where that mode speculates) is compiled for the
current backend, the operations of its entry computation are counted by opcode and by the
jax operation they came from (``op_name`` without the jit prefix), and the operations one
system has beyond the first are listed. ``--out`` keeps each compiled HLO text.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re

SKIP = ("parameter", "get-tuple-element", "bitcast", "constant", "tuple")


def entry_ops(text: str) -> list[tuple[str, str, str]]:
  """(opcode, op_name without its jit prefix, result shape) of every entry operation."""
  out = []
  for line in text[text.index("ENTRY"):].splitlines()[1:]:
    m = re.search(r"= (\S+) ([\w-]+)\(", line)
    if not m or m.group(2) in SKIP:
      continue
    name = re.search(r'op_name="([^"]+)"', line)
    out.append((m.group(2), "/".join(name.group(1).split("/")[1:]) if name else "?",
                m.group(1)))
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("overrides", nargs="*")
  p.add_argument("--config", default="experiments/quickstart/config.yaml")
  p.add_argument("--systems", default="resident,ula")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--context", type=int, default=1152)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  from ula_jax.config import load_config
  from ula_jax.engine import Engine
  from ula_jax.mesh import build_mesh, configure_platform

  counts = {}
  for system in args.systems.split(","):
    cfg = load_config(args.config, [
        "mesh.dp=1", "mesh.tp=1", f"engine.max_batch={args.batch}",
        f"engine.max_context={args.context}", "engine.progress=false",
        f"memory.system={system}", f"memory.device_pool={args.batch * args.context}",
        "memory.host_pool=0"] + args.overrides)
    configure_platform(cfg)
    text = Engine(cfg, build_mesh(cfg), max_context=args.context).decode_hlo()
    if args.out:
      pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
      pathlib.Path(args.out, f"{system}.hlo.txt").write_text(text)
    ops = entry_ops(text)
    counts[system] = collections.Counter((op, name) for op, name, _ in ops)
    by_op = collections.Counter(op for op, _, _ in ops)
    print(f"{system}: {len(ops)} operations: {dict(by_op.most_common(10))}")
  first, *rest = counts
  for system in rest:
    extra = counts[system] - counts[first]
    print(f"{system} beyond {first}: {sum(extra.values())} operations")
    for (op, name), n in extra.most_common(30):
      print(f"  {n:4d}  {op:12s} {name[:100]}")


if __name__ == "__main__":
  main()
