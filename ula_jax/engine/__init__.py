"""The serving engine (host-side scheduling over jitted, sharded steps)."""

from ula_jax.engine.types import Request, RequestResult, RunResult, StepMetrics


def __getattr__(name):
  # The engine pulls in the model and jax; import it only when asked for.
  if name in ("Engine", "RunState", "resolve_max_context"):
    from ula_jax.engine import engine
    return getattr(engine, name)
  raise AttributeError(name)


__all__ = ["Engine", "Request", "RequestResult", "RunResult", "RunState", "StepMetrics",
           "resolve_max_context"]
