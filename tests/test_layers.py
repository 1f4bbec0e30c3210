"""The package is layered: every module imports only its own layer and those below it,
and no imports run in a circle. The table below is the architecture (README, code map)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import ula_jax
from ula_jax.memory import registry

ROOT = pathlib.Path(ula_jax.__file__).parent

# Lowest first. A module belongs to the longest prefix that names it.
LAYERS: list[tuple[str, ...]] = [
    ("ula_jax.core",),  # shared types, sizes, addressing, jax compatibility
    ("ula_jax.kernels",),  # fetch, indexer, sparse attention: core and jax only
    ("ula_jax.models",),  # MLA + DSA transformer; takes a memory system, owns no KV
    ("ula_jax.config", "ula_jax.mesh"),  # the typed schema, loading, the device mesh
    ("ula_jax.memory",),  # memory systems (ula/ holds everything of ula's)
    ("ula_jax.engine",),  # scheduling, admission, the jitted steps
    ("ula_jax.workloads",),  # requests: synthetic or from a file
    ("ula_jax.report",),  # run directories, tables, plots, compare
    ("ula_jax.run",),  # one experiment end to end
    ("ula_jax.train",),  # training the model on text (ula-jax train)
    ("ula_jax.bench",),  # benchmarks
    ("ula_jax.experiments",),  # the papers' questions as experiments (ula-jax experiment)
    ("ula_jax.cli",),  # the command line, multi-process launch
]


def _modules() -> dict[str, pathlib.Path]:
  mods = {}
  for f in ROOT.rglob("*.py"):
    parts = f.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    mods[".".join(parts)] = f
  return mods


def _imports(name: str, f: pathlib.Path, mods: dict) -> set[str]:
  """Modules of the package that ``name`` imports (relative imports resolved)."""
  out = set()
  is_pkg = f.name == "__init__.py"
  for node in ast.walk(ast.parse(f.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith("ula_jax")}
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        m = ".".join(base + ([node.module] if node.module else []))
      else:
        m = node.module or ""
      if m.startswith("ula_jax"):
        for a in node.names:
          out.add(f"{m}.{a.name}" if f"{m}.{a.name}" in mods else m)
  return {t for t in out if t in mods and t != name}


def layer_of(module: str) -> int:
  best, layer = -1, None
  for i, prefixes in enumerate(LAYERS):
    for p in prefixes:
      if (module == p or module.startswith(p + ".")) and len(p) > best:
        best, layer = len(p), i
  if layer is None:
    raise AssertionError(f"{module} is in no layer of tests/test_layers.py LAYERS")
  return layer


def _graph() -> dict[str, set[str]]:
  mods = _modules()
  return {m: _imports(m, f, mods) for m, f in mods.items() if m != "ula_jax"}


def test_every_import_points_down():
  bad = []
  for m, targets in sorted(_graph().items()):
    for t in sorted(targets):
      if t != "ula_jax" and layer_of(t) > layer_of(m):
        bad.append(f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})")
  assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_core_imports_nothing_else_of_the_package():
  for m, targets in _graph().items():
    if layer_of(m) == 0:
      assert all(layer_of(t) == 0 for t in targets), (m, targets)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycles():
  assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert layer_of("ula_jax.memory.ula.resolve.pallas") == layer_of("ula_jax.memory")
  with pytest.raises(AssertionError, match="no layer"):
    layer_of("elsewhere.module")


def test_registry_names_the_class_for_each_mesh():
  from ula_jax.memory.ula.dp import Ula
  from ula_jax.memory.ula.tp import UlaTP

  assert registry.system_class("ula", 1) is Ula
  assert registry.system_class("ula", 8) is UlaTP
  assert registry.system_class("resident", 1) is registry.system_class("resident", 4)
  with pytest.raises(ValueError, match=r"memory.system='nope': expected one of"):
    registry.system_class("nope")


def test_every_package_folder_is_a_package():
  # setuptools' find_packages skips a folder without __init__.py: a wheel would lack it.
  missing = [str(d.relative_to(ROOT.parent)) for d in ROOT.rglob("*")
             if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
             and not (d / "__init__.py").is_file()]
  assert not missing, missing
