"""Random JSON schemas and the checks of a structured output, for tests/test_json_budget.py
and bench/bench_json_budget.py (issue 32's property: within the budget, every output parses
and validates).

The schemas are what a user scripting ``--json-schema`` writes: nested objects and arrays,
required and optional properties, enums, numeric bounds, string lengths, with and without
``additionalProperties``. Every one compiles with llguidance and has a valid instance.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import jsonschema

NAMES = ["id", "name", "items", "qty", "price", "tags", "paid", "note", "city", "sku",
         "total", "user", "email", "status", "count", "address", "lines", "ok", "score", "kind"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema (sometimes an array of objects) of up to three levels."""
    if depth == 0 and rng.random() < 0.15:
        return {"type": "array", "items": _object(rng, 1), "minItems": rng.choice([0, 1, 2])}
    return _object(rng, depth)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(NAMES, rng.randint(1, 4 if depth < 2 else 2))
    props = {n: _value(rng, depth + 1) for n in names}
    req = [n for n in names if rng.random() < 0.6]
    s: dict[str, Any] = {"type": "object", "properties": props}
    if req:
        s["required"] = req
    extra = rng.random()
    if extra < 0.3:
        s["additionalProperties"] = False
    elif extra < 0.4:
        s["additionalProperties"] = {"type": rng.choice(["integer", "string", "boolean"])}
    return s


def _value(rng: random.Random, depth: int) -> dict:
    kinds = ["integer", "number", "string", "boolean", "enum"]
    if depth < 3:
        kinds += ["object", "array", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        s: dict[str, Any] = {"type": "integer"}
        lo = rng.randint(-500, 500)
        if rng.random() < 0.5:
            s["exclusiveMinimum" if rng.random() < 0.3 else "minimum"] = lo
        if rng.random() < 0.5:
            s["exclusiveMaximum" if rng.random() < 0.3 else "maximum"] = lo + rng.randint(2, 2000)
        return s
    if kind == "number":
        s = {"type": "number"}
        lo = round(rng.uniform(-100, 100), rng.choice([0, 1, 2]))
        if rng.random() < 0.5:
            s["minimum"] = lo
        if rng.random() < 0.5:
            s["maximum"] = round(lo + rng.uniform(0.5, 50), 1)
        return s
    if kind == "string":
        s = {"type": "string"}
        if rng.random() < 0.4:
            s["minLength"] = rng.randint(1, 4)
        if rng.random() < 0.2:
            s["maxLength"] = s.get("minLength", 0) + rng.randint(2, 20)
        return s
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        pool = ["red", "green", "blue", "rush", "standard", "n/a", 1, 2, 10, None, True]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "object":
        return _object(rng, depth)
    s = {"type": "array", "items": _value(rng, depth + 1)}
    if rng.random() < 0.4:
        s["minItems"] = rng.randint(1, 3)
    if rng.random() < 0.3:
        s["maxItems"] = s.get("minItems", 0) + rng.randint(0, 3)
    return s


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys: {keys}")
    return dict(pairs)


def check_output(text: str, schema: Any) -> str | None:
    """Why ``text`` is not one valid instance of ``schema`` (None when it is): it must parse
    as JSON (no duplicate keys, no NaN/Infinity), validate with ``jsonschema``, and use the
    empty key only where the schema names it."""
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates,
                           parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except ValueError as e:
        return f"not JSON: {e}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return f"invalid: {e.message}"
    if _empty_key(value) and '""' not in json.dumps(schema):
        return "an empty key the schema does not name"
    if any(isinstance(v, float) and not math.isfinite(v) for v in _leaves(value)):
        return "a number that does not fit a float"
    return None


def _leaves(value: Any):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _empty_key(value: Any) -> bool:
    if isinstance(value, dict):
        return "" in value or any(_empty_key(v) for v in value.values())
    if isinstance(value, list):
        return any(_empty_key(v) for v in value)
    return False
