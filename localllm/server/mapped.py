"""Requests of other API families mapped onto the chat completion's parameters.

Anthropic's ``/v1/messages`` (:mod:`localllm.server.anthropic`) and OpenAI's ``/v1/responses``
(:mod:`localllm.server.responses`) read a body in their own shape, turn it into an
OpenAI-shaped chat request and run that as the same chat turn as ``/v1/chat/completions``.
The reading is the same for both: the body's JSON checked as every request's is
(:func:`~localllm.api.schema.parse`: depth, size, finite numbers, valid UTF-8, one error
line naming the field), the family's model validated leniently (fields this server has no use
for are ignored, as clients send many), then the chat request it maps to validated as
:class:`~localllm.api.schema.ChatParams`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from ..api.chat import TurnRun, prepare_chat
from ..api.schema import ChatParams, InvalidRequest, parse
from .protocol import read_json


class Lenient(BaseModel):
    """A request model of another API family: unknown fields ignored, numbers finite."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class MappedRequest(Lenient):
    """The fields every mapped request has: the model it names and whether it streams."""

    model: str | None = None
    stream: bool = False


R = TypeVar("R", bound=MappedRequest)


@dataclass(frozen=True)
class Mapped(Generic[R]):
    """A request in its family's shape (``req``) and the chat parameters it maps to."""

    req: R
    params: ChatParams

    @property
    def model(self) -> str | None:
        return self.req.model

    @property
    def stream(self) -> bool:
        return self.req.stream


def parse_mapped(body: bytes, model: type[R], to_chat: Callable[[R], dict[str, Any]]
                 ) -> Mapped[R]:
    """``body`` read as ``model``, and ``to_chat`` of it read as :class:`ChatParams`.

    Raises:
        InvalidRequest: the body is not a JSON object, a field of the wrong type or range
            (named by its path), or whatever ``to_chat`` refuses.
    """
    req = parse(model, read_json(body))
    return Mapped(req, parse(ChatParams, to_chat(req)))


def run_mapped(llm, parsed: Mapped, head: dict,
               events: Callable[[TurnRun, dict], Iterator[dict]],
               reply: Callable[[TurnRun, dict], dict], *, n_predict: int = -1,
               time_limit: float | None = None, cancel=None) -> dict | Iterator[dict]:
    """Run a mapped request's chat turn: ``events(run, head)`` (the family's stream events)
    when it streams, else ``reply(run, head)`` once the whole reply is in ``run.message``
    (``head``: the fields the family's reply starts with, its id and model ...).

    Args:
        n_predict, time_limit, cancel: see :func:`~localllm.api.chat.prepare_chat`.
    Raises:
        see :func:`~localllm.api.chat.prepare_chat`.
    """
    run = TurnRun(llm, prepare_chat(llm, parsed.params, n_predict=n_predict,
                                    time_limit=time_limit, cancel=cancel))
    if parsed.stream:
        return events(run, head)
    for _ in run:
        pass
    return reply(run, head)


def type_of(item: Any) -> Any:
    """An item's ``type`` (a content block, part or input item), None when it is no object."""
    return item.get("type") if isinstance(item, dict) else None


def texts_of(content: Any, where: str, kinds: Collection[str],
             refuse: Callable[[Any, str], InvalidRequest], what: str) -> list[str]:
    """The texts of ``content``: a string, or a list of parts of the ``kinds`` given, each
    with a string ``text`` (Anthropic's text blocks, the Responses API's ``input_text`` ...).

    Raises:
        InvalidRequest: ``content`` is neither a string nor a list ("must be a string or a
            list of ``what``"); ``refuse(type, path)`` for a part of another kind.
    """
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: must be a string or a list of {what}", where)
    texts = []
    for i, part in enumerate(content):
        if type_of(part) not in kinds or not isinstance(part.get("text"), str):
            raise refuse(type_of(part), f"{where}[{i}]")
        texts.append(part["text"])
    return texts


__all__ = ["Lenient", "Mapped", "MappedRequest", "parse_mapped", "run_mapped", "texts_of", "type_of"]
