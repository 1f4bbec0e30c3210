"""Readable config errors: pydantic's error list reformatted as dotted fields, the bad
value and what would be valid, all problems in one message."""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, Iterable

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
  """An invalid experiment config. ``problems`` holds one line per problem."""

  def __init__(self, problems: Iterable[str], source: str | None = None):
    self.problems = list(dict.fromkeys(problems))  # dedupe, keep order
    self.source = source
    where = f" ({source})" if source else ""
    if len(self.problems) == 1:
      msg = f"invalid config{where}: {self.problems[0]}"
    else:
      lines = "\n".join(f"  - {p}" for p in self.problems)
      msg = f"invalid config{where}: {len(self.problems)} problems\n{lines}"
    super().__init__(msg)


def suggest(name: str, valid: Iterable[str]) -> str:
  """' (did you mean 'x'?)' from the closest valid names, or '' when none is close."""
  close = difflib.get_close_matches(name, list(valid), n=3, cutoff=0.6)
  if not close:
    return ""
  return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


def _model_of(annotation: Any) -> type[BaseModel] | None:
  """The BaseModel class inside ``annotation`` (``X``, ``X | None``), if any."""
  if isinstance(annotation, type) and issubclass(annotation, BaseModel):
    return annotation
  if typing.get_origin(annotation) in (typing.Union, types.UnionType):
    for arg in typing.get_args(annotation):
      found = _model_of(arg)
      if found is not None:
        return found
  return None


def _walk(root: type[BaseModel], loc: tuple) -> tuple[str, type[BaseModel] | None, Any]:
  """Dotted path of ``loc`` (union tags dropped), the model owning its last field, and
  the last part that is not a field of that model (an unknown key), if any."""
  path = ""
  model: type[BaseModel] | None = root
  unknown = None
  for part in loc:
    if isinstance(part, int):
      path += f"[{part}]"
      continue
    if model is not None and part in model.model_fields:
      path = f"{path}.{part}" if path else part
      owner = model
      model = _model_of(owner.model_fields[part].annotation)
      continue
    # Union branch tags ('int', 'str', 'function-after[...]') are not fields.
    if model is not None and unknown is None:
      unknown = part
  return path, model, unknown


def _expected(etype: str, ctx: dict) -> str | None:
  bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
            "less_than": "<"}
  if etype in bounds:
    value = next(iter(ctx.values()))
    return f"must be {bounds[etype]} {value}"
  if etype == "literal_error":
    return f"expected one of {ctx['expected']}"
  return {
      "int_parsing": "expected an integer", "int_type": "expected an integer",
      "int_from_float": "expected an integer",
      "float_parsing": "expected a number", "float_type": "expected a number",
      "bool_parsing": "expected true or false", "bool_type": "expected true or false",
      "string_type": "expected a string",
      "model_type": "expected a mapping of fields", "dict_type": "expected a mapping of fields",
      "model_attributes_type": "expected a mapping of fields",
      "tuple_type": "expected a list", "list_type": "expected a list",
  }.get(etype)


def format_validation_error(err: ValidationError, root: type[BaseModel]) -> list[str]:
  """One readable line per problem in ``err`` (``root`` is the validated model class)."""
  problems: list[str] = []
  for e in err.errors(include_url=False):
    etype, loc, ctx = e["type"], tuple(e["loc"]), e.get("ctx") or {}
    value = e.get("input")
    if etype == "extra_forbidden":
      path, model, unknown = _walk(root, loc[:-1])
      name = str(loc[-1])
      dotted = f"{path}.{name}" if path else name
      valid = sorted(model.model_fields) if model is not None else []
      problems.append(f"unknown field {dotted!r}{suggest(name, valid)}; valid fields"
                      f"{' of ' + repr(path) if path else ''}: {', '.join(valid)}")
      continue
    path, section, _ = _walk(root, loc)
    if etype in ("value_error", "assertion_error"):
      msg = str(ctx.get("error", e["msg"]))
      for line in msg.splitlines():
        if path and not line.startswith(path) and f"{path}." not in line:
          # A section-level check names its own fields; a field check gets its value.
          line = f"{path}: {line}" if section is not None else f"{path}={value!r}: {line}"
        problems.append(line)
      continue
    if etype == "missing":
      problems.append(f"{path}: required, not set")
      continue
    expected = _expected(etype, ctx) or e["msg"]
    problems.append(f"{path}={value!r}: {expected}")
  return problems
