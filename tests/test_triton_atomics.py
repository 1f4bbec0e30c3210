"""What the Pallas resolve's kernels lower to for a GPU, checked on any machine: the
bitmap and counter atomics relaxed, the grid barriers' atomics acquire-release (the
Triton IR of a module lowered for CUDA, ``triton_kernels_ir``), and the stacked metadata
updated in place inside a scan over groups and inside the engine's decode step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jcore

from tests.engine_util import BASE, mesh_for
from tests.test_resolve_kernel import CASES, system_for
from ula_jax.core.compat import lower_for, scan_operand_counts
from ula_jax.config import load_config
from ula_jax.engine import Engine, resolve_max_context
from ula_jax.kernels import triton_ir
from ula_jax.memory.ula import atomics as triton_atomics
from ula_jax.memory.ula.resolve import resolve_group
from ula_jax.memory.ula.resolve import pallas as resolve_pallas
from ula_jax.memory.ula.resolve.pallas import FUSED_CONFIG, ResolveConfig


def lowered_kernels(config: ResolveConfig, programs: int = 8) -> dict[str, tuple[int, int]]:
  """{kernel: (relaxed atomics, acquire-release atomics)} of the Pallas resolve of the
  ``pb_lru`` test case, lowered for CUDA."""
  case = CASES["pb_lru"]
  system = system_for(case)
  sel = jnp.zeros((case.B, case.k), jnp.int32)
  g = resolve_pallas._Geometry.build(
      B=case.B, k=case.k, N=system.num_logical, Sd=system.device_slots, Hr=system.host_rows,
      R=system.buckets, policy="pb_lru", config=config,
      programs=programs if config.fuse else 1)
  # Two groups' metadata, stacked, resolving the second (as inside a decode step).
  meta = jax.tree.map(lambda x: jnp.stack([x, x]), system.init_group_meta())
  text = lower_for(resolve_pallas._resolve.trace(
      meta, jnp.ones((1,), jnp.int32), sel, sel >= 0, sel[:, 0], sel[:, 0] >= 0, g=g,
      interpret=False)).as_text()
  count = lambda ir, sem: len(re.findall(rf"tt.atomic_rmw \w+, {sem},", ir))
  return {name: (count(ir, "relaxed"), count(ir, "acq_rel"))
          for name, ir in triton_ir.triton_kernels_ir(text).items()}


def test_resolve_atomics_are_relaxed_and_barriers_acquire_release():
  # Fails loudly if a jax version no longer lets the relaxed primitive lower.
  assert triton_atomics.RELAXED_AVAILABLE
  fused = lowered_kernels(FUSED_CONFIG)
  assert list(fused) == ["ula_resolve_fused"]
  relaxed, acq_rel = fused["ula_resolve_fused"]
  assert relaxed > 0 and acq_rel == 2 * resolve_pallas._BARRIERS  # arrive + poll each
  staged = lowered_kernels(ResolveConfig())
  assert sorted(staged) == ["ula_resolve_mark", "ula_resolve_place", "ula_resolve_publish",
                            "ula_resolve_round"]
  assert all(r > 0 and a == 0 for r, a in staged.values())


def test_atomic_kind_is_checked():
  with pytest.raises(ValueError, match=r"atomic kind='xor': expected one of \['add', 'and', "
                     r"'or'\]"):
    triton_atomics.atomic("xor", None, (0,), 1)


def _scan_over_groups_ir(fast_path: bool) -> tuple[str, list[str]]:
  """The StableHLO, lowered for CUDA, of a scan over three groups' stacked metadata that
  resolves each group with the four launches, and the stacked leaves' tensor types."""
  case = CASES["pb_lru"]
  system = system_for(case)
  meta = jax.tree.map(lambda x: jnp.stack([x] * 3), system.init_group_meta())
  sel = jnp.zeros((case.B, case.k), jnp.int32)

  def step(meta):
    def body(m, g):
      m, slots, *_ = resolve_group(system, m, sel, sel >= 0, sel[:, 0], sel[:, 0] >= 0,
                                   impl="pallas", interpret=False, fast_path=fast_path,
                                   group=g)
      return m, slots
    return jax.lax.scan(body, meta, jnp.arange(3, dtype=jnp.int32))

  text = lower_for(jax.jit(step).trace(meta)).as_text()
  mlir = {"int32": "i32", "uint32": "ui32"}
  types = {f"tensor<{'x'.join(map(str, x.shape))}x{mlir[x.dtype.name]}>"
           for x in jax.tree.leaves(meta) if x.ndim > 1}
  return text, sorted(types)


def test_stacked_resolve_slices_no_metadata_in_a_decode_scan():
  """Inside the scan over groups, the kernels read and write the stacked metadata in
  place: no dynamic slice takes a group's table, owners or bitmaps out and no dynamic
  update slice writes them back (on the GPU each was a copy, several outside the CUDA
  graphs). The all-hit fast path's conditional still takes the group's slice."""
  def moved(text, types):
    lines = [l for l in text.splitlines()
             if "stablehlo.dynamic_slice" in l or "stablehlo.dynamic_update_slice" in l]
    return [t for t in types if any(t in l for l in lines)]

  text, types = _scan_over_groups_ir(fast_path=False)
  assert len(re.findall(r"stablehlo.custom_call", text)) == 4  # the four launches
  assert not moved(text, types)
  assert moved(*_scan_over_groups_ir(fast_path=True)) == types


_VIEWS = frozenset({"reshape", "squeeze", "expand_dims"})  # same buffer, another shape
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "shard_map",
                    "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint"})


def _inner(v):
  return v.jaxpr if isinstance(v, jcore.ClosedJaxpr) else v


def in_place_operands(jaxpr, problems: list[str], path: str = "") -> set[int]:
  """Which of ``jaxpr``'s inputs some kernel updates in place (a ``pallas_call``
  operand aliased to an output, followed through reshapes, nested calls, conditionals,
  scan and while carries). An operand updated in place must not be read afterwards, nor
  be a scan's or loop's constant, nor its scanned input: XLA would copy it (``problems``
  names each such case)."""
  root: dict = {}

  def r(v):
    while v in root:
      v = root[v]
    return v

  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _VIEWS and isinstance(eqn.invars[0], jcore.Var):
      root[eqn.outvars[0]] = eqn.invars[0]
  out: set[int] = set()
  for i, eqn in enumerate(jaxpr.eqns):
    name, where = eqn.primitive.name, f"{path}/{eqn.primitive.name}"
    consumed: set[int] = set()
    if name == "pallas_call":
      consumed = set(dict(eqn.params.get("input_output_aliases", ())))
    elif name in _CALLS:
      key = next((k for k in ("jaxpr", "call_jaxpr") if k in eqn.params), None)
      if key is not None:
        consumed = in_place_operands(_inner(eqn.params[key]), problems, where)
    elif name == "scan":
      nc, ncar = scan_operand_counts(eqn.params)
      for j in in_place_operands(_inner(eqn.params["jaxpr"]), problems, where):
        if nc <= j < nc + ncar:
          consumed.add(j)
        else:
          problems.append(f"{where}: {'constant' if j < nc else 'scanned'} operand {j} "
                          f"{eqn.invars[j].aval.str_short()} updated in place")
    elif name == "while":
      cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
      for j in in_place_operands(_inner(eqn.params["body_jaxpr"]), problems, where):
        if j < bn:
          problems.append(f"{where}: constant operand {j} updated in place")
        else:
          consumed.add(cn + j)
    elif name == "cond":
      for b in eqn.params["branches"]:
        consumed |= {j + 1 for j in in_place_operands(_inner(b), problems, where)}
    for j in sorted(consumed):
      v = eqn.invars[j]
      if not isinstance(v, jcore.Var):
        continue
      rv = r(v)
      later = [e.primitive.name for e in jaxpr.eqns[i + 1:] if e.primitive.name not in _VIEWS
               and any(isinstance(x, jcore.Var) and r(x) is rv for x in e.invars)]
      if later or any(isinstance(x, jcore.Var) and r(x) is rv for x in jaxpr.outvars):
        problems.append(f"{where}: operand {j} {v.aval.str_short()} read after its update "
                        f"in place ({later[:3]})")
      if rv in jaxpr.invars:
        out.add(jaxpr.invars.index(rv))
  return out


@pytest.mark.parametrize("resolve,policy", [("pallas", "pb_lru"), ("pallas_fused", "pb_lru"),
                                            ("pallas", "lru")])
def test_decode_step_updates_the_carried_metadata_in_place(resolve, policy):
  """In the engine's whole decode step (every group, every layer), the arrays the
  resolve kernels update in place are exactly the carried state's metadata, and nothing
  reads one of them after its update: XLA has no reason to copy any (checked on the
  step's jaxpr, the kernels' aliasing followed through every call, scan and loop)."""
  cfg = load_config(BASE, ["model.preset=tiny", "engine.progress=false", "memory.system=ula",
                           "memory.device_pool=4096", "memory.host_pool=1024",
                           f"memory.policy={policy}", f"kernels.resolve={resolve}",
                           "kernels.resolve_fast_path=false", "engine.pack_state=false"])
  engine = Engine(cfg, mesh_for(1), max_context=resolve_max_context(cfg))
  args = (engine.params, engine.carry, engine.idle_decode_inputs())
  problems: list[str] = []
  got = in_place_operands(jax.make_jaxpr(engine._decode)(*args).jaxpr, problems)
  assert not problems
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
  assert {paths[j] for j in got} == {p for p in paths if p.startswith("[1].meta.")}


def test_in_place_operands_finds_reads_after_an_update_and_constants():
  """The checker itself: a read after the update and an updated scan constant are named;
  an updated carry is followed out to the function's input."""
  from jax.experimental import pallas as pl

  def bump(x):
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] + 1
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          input_output_aliases={0: 0}, interpret=True)(x)

  x = jnp.zeros((8,), jnp.int32)
  cases = {
      "fine": (lambda x: bump(x), {0}, 0),
      "read after": (lambda x: bump(x) + x, {0}, 1),
      "carry": (lambda x: jax.lax.scan(lambda c, _: (bump(c), None), x, None, length=2)[0],
                {0}, 0),
      "constant": (lambda x: jax.lax.scan(lambda c, _: (c + bump(x), None), x, None,
                                          length=2)[0], set(), 1),
  }
  for name, (f, want, n_problems) in cases.items():
    problems: list[str] = []
    assert in_place_operands(jax.make_jaxpr(f)(x).jaxpr, problems) == want, name
    assert len(problems) == n_problems, (name, problems)
