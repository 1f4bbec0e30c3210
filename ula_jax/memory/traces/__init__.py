"""Selection traces: what decoding selected, replayed through memory systems without the
model.

* ``format.py``: ``SelectionTrace`` (one dp rank's prefill / decode / release events;
  ``.npz`` or a directory of memory-mapped ``.npy``), ``TraceRecorder`` (the engine's
  ``engine.record_trace``), ``load_traces``, ``trace_requests``;
* ``replay.py``: a trace through any memory system, metadata only (``replay``:
  the system's jax transitions on a state with one-column rows, or ``fast.py``'s NumPy
  models of ula DP, hisparse and resident, which make the same choices);
* ``stats.py``: locality statistics (overlap of consecutive steps, reuse distances,
  per-request LRU buffer and shared-pool miss rates);
* ``build.py``, ``generate.py``, ``sglang.py``: traces from per-request selections: a
  synthetic generator with stated locality, and SGLang's ``indexer_topk`` arrays.

``ula_jax.memory.ula.trace`` replays a recorded trace under ula's policies side by side
(a run's ``policy_comparison``); ``ula_jax.workloads.trace`` is ``workload.kind: trace``.
"""

from ula_jax.memory.traces.format import (DECODE, PREFILL, RELEASE, SelectionTrace, TraceError,
                                          TraceRecorder, TraceRequests, load_traces,
                                          trace_requests)

__all__ = ["DECODE", "PREFILL", "RELEASE", "SelectionTrace", "TraceError", "TraceRecorder",
           "TraceRequests", "load_traces", "trace_requests"]
