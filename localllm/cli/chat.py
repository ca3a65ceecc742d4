"""The ``localllm chat`` command (typer function registered in :mod:`localllm.cli.app`); the
REPL itself is :mod:`localllm.cli.repl`, imported when the command runs."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import ParameterError
from .chat_options import ReasoningBudgetOpt, ReasoningFormatOpt, TemplateKwargsOpt
from .options import ThreadsBatchOpt, ThreadsOpt, apply_threads


def chat_command(
    model: Annotated[str | None, typer.Argument(
        help="models.toml name or .gguf path (default: smollm2-135m-instruct)")] = None,
    system: Annotated[str | None, typer.Option("--system", help="system prompt")] = None,
    chat_template: Annotated[str | None, typer.Option(
        "--chat-template", help="built-in template NAME (gemma, llama3, chatml, mistral, "
        "llama2, phi3), metadata variant NAME, or a template FILE")] = None,
    ctx_size: Annotated[int, typer.Option("--ctx-size", "-c", help="context size in tokens")] = 4096,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="prefill chunk")] = 512,
    keep: Annotated[int, typer.Option(
        "--keep", help="tokens at the start of the conversation kept by a context shift "
        "(-1: all)")] = 0,
    no_context_shift: Annotated[bool, typer.Option(
        "--no-context-shift", help="end the reply when the context is full")] = False,
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", "-r", help="stop string (repeatable)")] = None,
    n_predict: Annotated[int, typer.Option(
        "--n-predict", "-n", help="most tokens per reply (-1: no limit)")] = 1024,  # repl.DEFAULT_REPLY_TOKENS
    no_loop_guard: Annotated[bool, typer.Option(
        "--no-loop-guard", help="let a reply that repeats itself go on")] = False,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda")] = "auto",
    threads: ThreadsOpt = None,
    threads_batch: ThreadsBatchOpt = None,
    reasoning_format: ReasoningFormatOpt = "auto",
    reasoning_budget: ReasoningBudgetOpt = -1,
    chat_template_kwargs: TemplateKwargsOpt = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="details on stderr")] = False,
    sampling=None,
    speculative=None,
    kv_cache=None,
) -> None:
    """Chat with a model in the terminal (streaming, /help for commands)."""
    from .chat_options import parse_reasoning_options

    variables, reasoning_format = parse_reasoning_options(reasoning_format, reasoning_budget,
                                                          chat_template_kwargs)
    from rich.console import Console

    from .progress import step_progress

    with step_progress("starting: importing torch"):  # seconds of a blank screen otherwise
        from ..api import LLM
        from ..chat.template import template_for
        from .repl import ChatREPL

    apply_threads(threads, threads_batch)
    if model is None:  # chat's own default: an instruct model
        from ..registry import load_registry

        reg = load_registry()
        model = reg.chat_default or reg.default
    llm = LLM(  # its own progress bar while the weights load (on a terminal)
        model, device=device, ctx_size=ctx_size, batch_size=batch_size, verbose=verbose,
        **(speculative or {}), **(kv_cache or {}))
    if sampling is None:
        params = llm.sampling_params()
    elif hasattr(sampling, "overrides"):
        params = llm.sampling_params(**sampling.overrides)
    else:
        params = llm.sampling_params(sampling)
    if n_predict < -1:
        raise ParameterError(f"--n-predict must be -1 (no limit) or >= 0, got {n_predict}")
    template = template_for(llm, chat_template, files=True)
    if system is None and llm.entry is not None:
        system = llm.entry.system  # the model's default (models.toml `system`, Ollama's)
    console = Console(highlight=False)
    repl = ChatREPL(llm, console=console, template=template, params=params, system=system,
                    keep=keep, context_shift=not no_context_shift, stop=stop or (),
                    n_predict=n_predict, loop_guard=not no_loop_guard,
                    reasoning_format=reasoning_format, reasoning_budget=reasoning_budget,
                    variables=variables)
    if verbose:
        console.print(f"model {llm.path}, template {template.name}, device {llm.device}",
                      style="dim", markup=False)
    console.print("/help for commands, Ctrl-D to leave", style="dim", markup=False)
    repl.run()


__all__ = ["chat_command"]
