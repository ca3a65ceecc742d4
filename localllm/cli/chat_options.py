"""The reasoning and template-variable flags shared by ``run --chat``, ``chat`` and ``serve``
(llama.cpp's ``--reasoning-format``, ``--reasoning-budget``, ``--chat-template-kwargs``)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ..chat.reasoning import REASONING_FORMATS
from ..errors import ParameterError

ReasoningFormatOpt = Annotated[str, typer.Option(
    "--reasoning-format", help="none: a thinking model's reasoning stays in the reply; "
    "deepseek, auto: it is split off (reasoning_content; dimmed in the REPL)")]
ReasoningBudgetOpt = Annotated[int, typer.Option(
    "--reasoning-budget", help="reasoning tokens per reply (-1: no limit, 0: no thinking; a "
    "spent budget closes the block and the answer follows)")]
TemplateKwargsOpt = Annotated[str | None, typer.Option(
    "--chat-template-kwargs", help="JSON object of template variables, e.g. "
    "'{\"enable_thinking\": false}'")]


def parse_reasoning_options(reasoning_format: str, reasoning_budget: int,
                            chat_template_kwargs: str | None) -> tuple[dict, str]:
    """(template variables, reasoning format) of the flags.

    Raises:
        ParameterError: an unknown format, a budget below -1, template variables that are
            not a JSON object.
    """
    if reasoning_format not in REASONING_FORMATS:
        raise ParameterError(f"--reasoning-format must be one of {', '.join(REASONING_FORMATS)}"
                             f", got {reasoning_format!r}")
    if reasoning_budget < -1:
        raise ParameterError(f"--reasoning-budget must be -1 (no limit), 0 (no thinking) or a "
                             f"number of tokens, got {reasoning_budget}")
    kwargs: dict = {}
    if chat_template_kwargs is not None:
        try:
            kwargs = json.loads(chat_template_kwargs)
        except ValueError as e:
            raise ParameterError(f"--chat-template-kwargs: not valid JSON ({e})") from None
        if not isinstance(kwargs, dict):
            raise ParameterError("--chat-template-kwargs must be a JSON object")
        if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
            raise ParameterError("--chat-template-kwargs: enable_thinking must be true or false")
    if reasoning_budget == 0:
        kwargs.setdefault("enable_thinking", False)
    return kwargs, reasoning_format


__all__ = ["ReasoningBudgetOpt", "ReasoningFormatOpt", "TemplateKwargsOpt",
           "parse_reasoning_options"]
