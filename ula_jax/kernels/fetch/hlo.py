"""Checks on compiled HLO: does a row copy move (or materialise) a whole pool?

A Pallas or FFI kernel handed a ``pinned_host`` pool must read it in place. If XLA
instead copies the pool to the device (or back), the compiled module contains an
instruction whose result has the pool's shape: a ``copy``/``copy-start``, or a fusion that
computes a whole new pool (a convert, a select). ``pool_materializations`` lists those;
the GPU tests and the fetch benchmark fail or report on them.

A fusion whose root is a ``scatter`` or a ``dynamic-update-slice`` of the pool writes a
few rows of it in place: its result shares the pool's buffer, and where that buffer is
still needed elsewhere, XLA's copy insertion puts a ``copy`` of the pool before it, which
is flagged.
"""

from __future__ import annotations

import re

# Instructions that name a buffer without moving it. A ``while`` (the layer stack's loop
# over groups) or ``conditional`` returns its carried buffers in place: a copy XLA needs
# around one is a ``copy`` of its own, and the bodies are checked like any computation.
_PASS_THROUGH = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "while",
                           "conditional", "call"})
# The copy kernels themselves: their result is the (aliased) destination pool.
KERNEL_MARKERS = ("triton", "ula_jax_fetch_rows", "ula_jax_evict_rows")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s+"
                    r"(?P<op>[a-z][\w\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*->.*\{\s*$")
_FUSION_CALLS = re.compile(r"\bfusion\(.*\bcalls=%?(?P<name>[\w.\-]+)")
# Roots of fused computations that update their first operand in place.
_IN_PLACE_ROOTS = frozenset({"scatter", "dynamic-update-slice"})


def pool_materializations(hlo_text: str, pool_shape: tuple[int, ...], *,
                          allow_kernel: bool = True) -> list[str]:
  """Lines of ``hlo_text`` that produce a buffer of ``pool_shape``.

  hlo_text:     ``jax.jit(f).lower(...).compile().as_text()``
  pool_shape:   the pool's shape, e.g. (Sh, W); pick sizes no other value has
  allow_kernel: skip instructions that are the copy kernel itself (Triton fusions and
                custom calls, the ula_jax FFI targets), whose result is the aliased pool
  returns the offending instruction lines (empty: the pool is never copied)

  Instructions inside fusion bodies are not buffers (a fused gather computes only the
  elements it reads); the fusion's own result, in its caller, is.
  """
  dims = re.compile(r"\[" + r",\s*".join(str(int(d)) for d in pool_shape) + r"\]")
  lines = hlo_text.splitlines()
  fused = {m.group("name") for line in lines if (m := _FUSION_CALLS.search(line))}
  roots, computation = {}, None  # fused computation -> its root's opcode
  for line in lines:
    if (c := _COMPUTATION.match(line)) is not None:
      computation = c.group("name")
    elif line.lstrip().startswith("ROOT") and (m := _INSTR.match(line)) is not None:
      roots[computation] = m.group("op")
  found, computation = [], None
  for line in lines:
    if (c := _COMPUTATION.match(line)) is not None:
      computation = c.group("name")
      continue
    if computation in fused:
      continue
    m = _INSTR.match(line)
    if m is None or not dims.search(m.group("type")):
      continue
    if m.group("op") in _PASS_THROUGH:
      continue
    if (m.group("op") == "fusion" and (f := _FUSION_CALLS.search(line)) is not None
        and roots.get(f.group("name")) in _IN_PLACE_ROOTS):
      continue
    if allow_kernel and any(k in line.lower() for k in KERNEL_MARKERS):
      continue
    found.append(line.strip())
  return found


def host_parameter_shapes(hlo_text: str) -> list[str]:
  """Entry parameter/result layouts placed in host memory (``S(5)``), from the module's
  ``entry_computation_layout``: shows that a pool really was passed in host memory."""
  m = re.search(r"entry_computation_layout=\{(.*)\}", hlo_text)
  if m is None:
    return []
  return re.findall(r"\w+\[[\d,]*\]\{[\d,]*:[^}]*S\(5\)[^}]*\}", m.group(1))
