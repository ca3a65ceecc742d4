"""The shapes the server answers in: JSON text, error objects and stream events of each API
family (OpenAI's here; Anthropic's in :mod:`localllm.server.anthropic`, the Responses API's in
:mod:`localllm.server.responses`), shared by the endpoint modules."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from ..api.schema import InvalidRequest


def error_body(message: str, kind: str = "invalid_request_error", *, param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def dumps(value: Any) -> str:
    """JSON text of a response: non-ASCII kept, but lone surrogates (a tool call's arguments
    may decode to them) escaped and non-finite numbers written as null, so that the text is
    always valid JSON and valid UTF-8."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return json.dumps(value, allow_nan=False)
    except ValueError:  # NaN or infinity somewhere
        return dumps(_finite(value))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


class JSONReply(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")


@dataclass
class Failure:
    """An error to answer with, in whichever API's shape the endpoint speaks."""

    status: int
    message: str
    kind: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict | None = None


class Style:
    """How an API family writes errors and stream events: OpenAI's (``data: {json}`` events
    ending with ``data: [DONE]``). :mod:`localllm.server.anthropic` has Anthropic's."""

    done: str | None = "[DONE]"

    def error(self, f: Failure) -> dict:
        return error_body(f.message, f.kind, param=f.param, code=f.code)

    def reply(self, f: Failure) -> JSONResponse:
        return JSONReply(self.error(f), status_code=f.status, headers=f.headers)

    def event(self, item: Any) -> dict:
        """An item of the call's stream as sse-starlette's event dict."""
        return {"data": dumps(item)}

    def tally(self, item: Any) -> tuple[dict, int, int] | None:
        """(llama-server ``timings``, prompt tokens, generated tokens) when ``item`` closes a
        reply, for ``/metrics`` and the request log."""
        if isinstance(item, dict) and "timings" in item and "usage" in item:
            usage = item["usage"]
            return item["timings"], usage["prompt_tokens"], usage["completion_tokens"]
        return None


OPENAI = Style()


def read_json(body: bytes) -> Any:
    """A request body's JSON value.

    Raises:
        InvalidRequest: not JSON, or nested too deeply to parse.
    """
    try:
        return json.loads(body)
    except ValueError:  # JSONDecodeError, bad UTF-8
        raise InvalidRequest("the request body is not valid JSON") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply to parse") from None


__all__ = ["OPENAI", "Failure", "JSONReply", "Style", "dumps", "error_body",
           "read_json"]
