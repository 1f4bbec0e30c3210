"""Benchmarks: each module has ``main(argv: list[str]) -> int``, prints a table and writes
JSON (``ula-jax bench NAME``; ``BENCHMARKS`` lists the module names).

* ``fetch``: row fetch/evict between a pinned-host pool and a device pool, every
  implementation, as a fraction of a contiguous copy of the same bytes in the same run.
* ``attention``: sparse MLA decode attention, bytes it must read per second as a fraction
  of a device-to-device copy measured in the same run.
* ``step_cost``: an all-hit decode step of each memory system against ``resident``.
* ``tp_link``: TP mode's cross-device miss delivery against a device-to-device copy.
* ``kernel_report``: what the Pallas sparse attention compiles to for a Hopper GPU
  (shared memory, registers, spills, its main loop), read on any machine with the
  ``triton`` package (no GPU).
* ``compile``: compile seconds and compiled-HLO operations of the decode step and a
  prefill chunk against the model's depth (the layer stack is a loop over groups).
* ``serving``: capacity and tokens/s against running batch of every system on every
  device of the host at equal device and host budgets (a table, JSON and a plot).
* ``prefill``: computed prefill of one long prompt (prompt tokens/s) and its parts
  (indexer selection, attention, the rest) against FLOP and byte ceilings.
* ``kernels_table``: the table of ``kernels.*: auto`` (``ula_jax/kernels/auto_table.json``)
  from the JSON of ``fetch``, ``attention``, ``resolve`` and ``prefill`` runs on GPUs.

``fetch`` and ``attention`` import neither ``ula_jax.config`` nor the model, so they run
wherever jax does. ``summary`` condenses their JSON (``python -m ula_jax.bench.summary``).
"""

from __future__ import annotations

BENCHMARKS = ("fetch", "attention", "resolve", "step_cost", "tp_link", "serving",
              "kernel_report", "compile", "prefill", "kernels_table")
