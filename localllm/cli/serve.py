"""``localllm serve``: the OpenAI-compatible HTTP server (llama-server's flags)."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from ..errors import ParameterError
from .chat_options import ReasoningBudgetOpt, ReasoningFormatOpt, TemplateKwargsOpt
from .options import ThreadsBatchOpt, ThreadsOpt, apply_threads


def serve_command(
    model: Annotated[str | None, typer.Argument(
        help="models.toml name or .gguf path (default: gemma3-270m)")] = None,
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port")] = 8080,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on "
        "/v1/* and /tokenize, /detokenize, /props",
        envvar="LOCALLLM_API_KEY")] = None,
    ctx_size: Annotated[int, typer.Option(
        "--ctx-size", "-c", help="context size in tokens")] = 4096,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", help="prefill chunk")] = 512,
    n_predict: Annotated[int, typer.Option(
        "--n-predict", "-n", help="most tokens one request may generate; caps max_tokens "
        "(-1: the context)")] = -1,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="seconds one request may generate before it is stopped with an "
        "error")] = 600.0,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda")] = "auto",
    chat_template: Annotated[str | None, typer.Option(
        "--chat-template", help="template NAME or FILE")] = None,
    max_queue: Annotated[int, typer.Option(
        "--max-queue", help="requests that may wait (more get 503)")] = 64,
    max_body: Annotated[int, typer.Option(
        "--max-body", help="largest request body in bytes (more get 413)")] = 8 << 20,
    threads: ThreadsOpt = None,
    threads_batch: ThreadsBatchOpt = None,
    reasoning_format: ReasoningFormatOpt = "auto",
    reasoning_budget: ReasoningBudgetOpt = -1,
    chat_template_kwargs: TemplateKwargsOpt = None,
    cors_origins: Annotated[str | None, typer.Option(
        "--cors-origins", help="comma-separated browser origins allowed to call the server "
        "('*': any)")] = None,
    pooling: Annotated[str | None, typer.Option(
        "--pooling", help="embeddings pooling: mean, cls or last (default: the model's, "
        "else mean)")] = None,
    max_models: Annotated[int, typer.Option(
        "--max-models", help="models loaded at once (the least recently used is unloaded "
        "to load another)")] = 3,
    keep_alive: Annotated[str, typer.Option(
        "--keep-alive", help="unload a model after this long without a request (30s, 5m, "
        "1h; -1: never), as Ollama's keep_alive; not the model started with")] = "5m",
    alias: Annotated[list[str] | None, typer.Option(
        "--alias", "-a", help="another name requests may use for MODEL (repeatable)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="uvicorn's own log")] = False,
    speculative=None,
    kv_cache=None,
) -> None:
    """Serve MODEL over HTTP: OpenAI's /v1/chat/completions, /v1/completions,
    /v1/responses, /v1/embeddings, /v1/models; Anthropic's /v1/messages; llama-server's
    /tokenize, /detokenize, /props, /health, /metrics; Ollama's /api/ps. A request's model
    may name another model of models.toml or the stores (`localllm models`): it is loaded on
    first use. One line per request goes to stderr."""
    if not 0 <= port <= 65535:
        raise ParameterError(f"--port must be 0..65535, got {port}")
    if max_queue < 0:
        raise ParameterError(f"--max-queue must be >= 0, got {max_queue}")
    if max_body < 1:
        raise ParameterError(f"--max-body must be >= 1, got {max_body}")
    if api_key == "":
        raise ParameterError("--api-key must not be empty")
    if n_predict < -1 or n_predict == 0:
        raise ParameterError(f"--n-predict must be -1 (the context) or >= 1, got {n_predict}")
    if not 0 < timeout < float("inf"):
        raise ParameterError(f"--timeout must be a number of seconds > 0, got {timeout}")
    from .chat_options import parse_reasoning_options

    kwargs, reasoning_format = parse_reasoning_options(reasoning_format, reasoning_budget,
                                                       chat_template_kwargs)
    if pooling is not None and pooling not in ("mean", "cls", "last"):
        raise ParameterError(f"--pooling must be mean, cls or last, got {pooling!r}")
    origins = tuple(o.strip() for o in (cors_origins or "").split(",") if o.strip())
    if max_models < 1:
        raise ParameterError(f"--max-models must be >= 1, got {max_models}")
    from ..server.models import for_server, parse_duration

    try:
        keep = parse_duration(keep_alive)
    except ValueError:
        raise ParameterError(f"--keep-alive: {keep_alive!r} is not a duration (30s, 5m, 1h, "
                             "-1)") from None
    if sys.stderr is None:  # started with stderr closed: the log goes nowhere, not to a crash
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives until exit

    import torch

    apply_threads(threads, threads_batch)
    n_threads = torch.get_num_threads()  # as in effect (OMP_NUM_THREADS without -t)
    from ..api import LLM
    from ..server import serve

    def setup(loaded) -> None:  # every model the server loads reads its reasoning this way
        loaded.chat_template_kwargs = kwargs
        loaded.reasoning_format = reasoning_format
        loaded.reasoning_budget = reasoning_budget

    llm = LLM(model, device=device, ctx_size=ctx_size, batch_size=batch_size, progress=None,
              **(speculative or {}), **(kv_cache or {}))
    setup(llm)
    if chat_template is not None:
        from ..chat.template import template_for

        # Read and compiled now (a broken template is an error here, not per request); the
        # server then holds the template itself, never a path.
        llm.chat_template = template_for(llm, chat_template, files=True)

    name = llm.model_name

    def ready(bound: int) -> None:
        print(f"localllm: serving {name} on http://{host}:{bound}/v1 "
              f"({n_threads} CPU thread{'s' if n_threads > 1 else ''}; Ctrl-C stops)",
              file=sys.stderr, flush=True)

    models = for_server(llm, model, device=device, ctx_size=ctx_size, batch_size=batch_size,
                        max_models=max_models, keep_alive=keep,
                        chat_template=llm.chat_template, options=speculative,
                        kv_cache=kv_cache,
                        aliases=tuple(alias or ()), setup=setup)
    del llm  # the manager holds the only reference: an eviction frees its memory
    serve(None, host=host, port=port, api_key=api_key, max_queue=max_queue, max_body=max_body,
          n_predict=n_predict, timeout=timeout, log_level="info" if verbose else "warning",
          on_ready=ready, cors_origins=origins, pooling=pooling, models=models)
