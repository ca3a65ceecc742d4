"""The ``localllm`` command line (typer). Thin: it parses flags and calls the library.

User errors (:class:`localllm.errors.LocalLLMError`) print one ``error:`` line on stderr
and exit 1; Ctrl-C exits 130; SIGTERM exits 143.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..errors import LocalLLMError, ParameterError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Run quantized GGUF language models locally.",
    context_settings={"help_option_names": ["-h", "--help"]},
)

ModelArg = Annotated[
    str | None, typer.Argument(help="models.toml name or .gguf path (default: gemma3-270m)")
]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu or cuda")]
CtxOpt = Annotated[int, typer.Option("--ctx-size", "-c", help="context size in tokens")]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", help="prefill chunk in tokens")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="timings and details on stderr")]
ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", "-t", help="CPU threads (default: physical cores)")]


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def read_prompt(prompt: str | None, file: Path | None) -> str:
    """The prompt from ``-f FILE``, ``-`` (stdin) or the argument.

    Raises:
        LocalLLMError: no prompt, an unreadable file, or an empty prompt.
    """
    if file is not None:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise LocalLLMError(f"-f {file}: cannot read prompt file: {e}") from None
    elif prompt == "-":
        text = sys.stdin.read()
    elif prompt is None:
        raise LocalLLMError("no prompt: give PROMPT, -f FILE, or - to read stdin")
    else:
        text = prompt
    if not text:
        raise LocalLLMError("the prompt is empty")
    return text


def print_model_summary(llm) -> None:
    """Model, device, backend and memory on stderr (``--verbose``)."""
    loaded = llm.loaded
    _err(f"model: {llm.path} ({loaded.gguf.architecture}, device {llm.device}, "
         f"backend {loaded.backend})")
    for name in loaded.fallbacks or ():
        _err(f"no {loaded.backend} kernel, dequantized: {name}")
    if llm.device.type == "cuda":
        import torch

        from ..runtime.graphs import GRAPHS_ENV, graphs_enabled

        _err("decode: static shapes, " + ("CUDA graphs" if graphs_enabled(llm.device)
                                           else f"no CUDA graphs ({GRAPHS_ENV}=0)"))
        _err(f"GPU memory: {torch.cuda.memory_allocated(llm.device) / 2**20:.0f} MiB allocated "
             f"(weights + KV cache + workspace)")


def print_timings(llm, timings, finish_reason: str | None) -> None:
    """llama.cpp-style performance summary on stderr."""
    t = timings

    def line(label: str, seconds: float, n: int) -> str:
        ms = seconds * 1e3
        per = ms / n if n else 0.0
        tps = n / seconds if seconds > 0 else 0.0
        return (f"{label:>18} = {ms:10.2f} ms / {n:5d} tokens ({per:8.2f} ms per token, "
                f"{tps:8.2f} tokens per second)")

    _err(f"{'load time':>18} = {llm.loaded.load_seconds * 1e3:10.2f} ms")
    _err(line("prompt eval time", t.prompt_seconds, t.prompt_tokens))
    _err(line("eval time", t.generate_seconds, max(0, t.generated_tokens - 1)))
    _err(f"{'first token':>18} = {t.first_token_seconds * 1e3:10.2f} ms")
    _err(f"{'finish reason':>18} = {finish_reason}")


# ---- run ----------------------------------------------------------------------------------
def _run(
    args: Annotated[list[str] | None, typer.Argument(
        help="[MODEL] PROMPT  (PROMPT '-' reads stdin)", show_default=False)] = None,
    model_opt: Annotated[str | None, typer.Option("--model", "-m", help="model name or path")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="read the prompt from FILE")] = None,
    n_predict: Annotated[int, typer.Option("--n-predict", "-n", help="tokens to generate (-1: no limit)")] = -1,
    ctx_size: CtxOpt = 4096,
    batch_size: BatchOpt = 512,
    device: DeviceOpt = "auto",
    special: Annotated[bool, typer.Option("--special", help="parse special-token text in the prompt")] = False,
    stop: Annotated[list[str] | None, typer.Option("--stop", "-r", help="stop string (repeatable)")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="apply the chat template to the prompt")] = False,
    system: Annotated[str | None, typer.Option("--system", help="system message (with --chat)")] = None,
    chat_template: Annotated[str | None, typer.Option("--chat-template", help="template NAME or FILE")] = None,
    grammar: Annotated[str | None, typer.Option("--grammar", help="GBNF grammar text")] = None,
    grammar_file: Annotated[str | None, typer.Option("--grammar-file", help="GBNF file or grammars/ name")] = None,
    json_mode: Annotated[bool, typer.Option("--json", help="output one JSON value")] = False,
    json_schema: Annotated[str | None, typer.Option("--json-schema", help="JSON schema FILE or inline")] = None,
    threads: ThreadsOpt = None,
    verbose: VerboseOpt = False,
    sampling=None,
) -> None:
    """Generate a continuation of PROMPT and stream it to stdout."""
    from ..cpu.threads import set_threads

    set_threads(threads)
    positional = list(args or [])
    if len(positional) > 2:
        raise LocalLLMError(f"too many arguments: {positional[2:]!r} (quote the prompt)")
    model = model_opt
    if model is None and (len(positional) == 2 or (file is not None and positional)):
        model = positional.pop(0)
    prompt = positional[0] if positional else None
    if n_predict < -2:
        raise ParameterError(f"-n/--n-predict must be -1 (no limit), -2 or >= 0, got {n_predict}")
    if system is not None and not chat:
        raise ParameterError("--system applies the chat template: use it with --chat")
    text = read_prompt(prompt, file)

    from ..api import LLM

    llm = LLM(model, device=device, ctx_size=ctx_size, batch_size=batch_size, progress=None)
    params = llm.sampling_params(**(sampling.overrides if sampling is not None else {}))
    if verbose:
        print_model_summary(llm)
    if chat:
        from ..chat.template import apply_chat

        ids = apply_chat(llm, text, system=system, template=chat_template)
    else:
        ids = llm.encode_prompt(text, special=special)
    constraint = None
    if grammar or grammar_file or json_mode or json_schema:
        from ..grammar.constraint import constraint_from_cli

        constraint = constraint_from_cli(grammar, grammar_file, json_mode, json_schema, llm.tokenizer)
    json_out = json_mode or json_schema is not None
    pieces: list[str] = []  # JSON mode prints the value only once it is complete
    finish = None
    out = sys.stdout
    try:
        for step in llm.stream(ids, params=params, n_predict=n_predict, stop=stop or (),
                               constraint=constraint):
            if params.n_probs > 0 and step.trace is not None:
                print_trace(llm.tokenizer, step.trace)
            if step.text:
                if json_out:
                    pieces.append(step.text)
                else:
                    out.write(step.text)
                    out.flush()
            finish = step.finish_reason
    except BrokenPipeError:  # `localllm run ... | head`: the reader has all it wanted
        _silence_stdout()
        return
    if verbose:
        _err(f"seed: {llm.last_sampler.seed}")
        print_timings(llm, llm.last_timings, finish)
    if constraint is not None and not constraint.is_accepting():
        raise LocalLLMError(f"generation ended ({finish}) before the grammar was complete")
    if json_out:
        out.write(one_line_json("".join(pieces)) + "\n")
    elif constraint is not None or out.isatty():
        out.write("\n")
    out.flush()


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that Python's exit flush does not fail again."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # not a real file
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until exit


def one_line_json(text: str) -> str:
    """The JSON value in ``text`` re-serialized on one line (non-ASCII kept)."""
    import json

    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError as e:
        raise LocalLLMError(f"the generated text is not valid JSON: {e}") from None


def print_trace(tokenizer, trace) -> None:
    """One stderr line per token for ``--logprobs N``: chosen token, log-probs, alternatives."""
    raw = "-" if trace.logprob is None else f"{trace.logprob:.4f}"
    alts = "  ".join(f"{tokenizer.token_text(t)!r} {lp:.4f}" for t, lp in trace.top)
    _err(f"{trace.token:>7} {tokenizer.token_text(trace.token)!r}  logprob {raw}  "
         f"processed {trace.processed_logprob:.4f}  | {alts}")


def _attach_sampling(func):
    try:
        from .sampling import sampling_options
    except ImportError:  # the sampling flags module is optional while it is being written
        return func
    return sampling_options(func)


app.command("run", no_args_is_help=True)(_attach_sampling(_run))


# ---- info / tokenize / models -------------------------------------------------------------
@app.command()
def info(model: ModelArg = None) -> None:
    """Architecture, hyperparameters, tokenizer and a per-type tensor table."""
    from .info import print_info

    print_info(model)


@app.command()
def tokenize(
    model: ModelArg = None,
    text: Annotated[str | None, typer.Argument(help="text to tokenize ('-' reads stdin)")] = None,
    no_bos: Annotated[bool, typer.Option("--no-bos", help="do not add BOS")] = False,
    special: Annotated[bool, typer.Option("--special", help="parse special-token text")] = False,
    pieces: Annotated[bool, typer.Option("--pieces", help="print id and piece per line")] = False,
) -> None:
    """Print the token ids of TEXT."""
    if text is None:  # one argument: it is the text, for the default model
        model, text = None, model
    text = read_prompt(text, None) if text != "" else ""
    from ..gguf.file import open_gguf
    from ..registry import load_registry
    from ..tokenizer import Tokenizer

    path, _ = load_registry().resolve(model)
    tok = Tokenizer(open_gguf(path).metadata)  # no weights needed
    ids = tok.encode(text, add_bos=not no_bos and tok.add_bos, special=special)
    if pieces:
        for i in ids:
            print(f"{i:>8} {tok.token_text(i)!r}")
    else:
        print(ids)


@app.command()
def models() -> None:
    """List the models of models.toml and whether each is present."""
    from rich.console import Console
    from rich.table import Table

    from ..registry import load_registry

    reg = load_registry()
    table = Table("name", "source", "status", "notes")
    for name, e in reg.models.items():
        table.add_row(name + (" (default)" if name == reg.default else ""), e.source, e.status(),
                      e.notes)
    Console().print(table)


@app.command()
def bench(
    model: ModelArg = None,
    n_prompt: Annotated[int, typer.Option("--n-prompt", "-p", help="prompt tokens (pp)")] = 512,
    n_gen: Annotated[int, typer.Option("--n-gen", "-n", help="generated tokens (tg)")] = 128,
    repetitions: Annotated[int, typer.Option("--repetitions", "-r")] = 3,
    device: DeviceOpt = "auto",
    synthetic: Annotated[str | None, typer.Option(
        "--synthetic", help="random weights shaped as llama3-8b, qwen2-7b or gemma3-270m")] = None,
    quant: Annotated[str, typer.Option(
        "--quant", help="recipe of --synthetic (Q4_K_M, Q8_0 ...)")] = "Q4_K_M",
    threads: ThreadsOpt = None,
    peak_bandwidth: Annotated[float | None, typer.Option(
        "--peak-bandwidth", help="device peak memory bandwidth in GB/s (for MBU)")] = None,
    llama_cpp: Annotated[bool, typer.Option(
        "--llama-cpp/--no-llama-cpp", help="also time llama-cpp-python when installed")] = True,
    json_out: Annotated[bool, typer.Option(
        "--json", help="print the figures as one JSON line")] = False,
) -> None:
    """Prefill (pp) and decode (tg) speed, time to first token, peak memory and bandwidth."""
    from ..cpu.threads import set_threads
    from ..eval.bench import run_bench

    threads = set_threads(threads)

    run_bench(model, n_prompt=n_prompt, n_gen=n_gen, repetitions=repetitions, device=device,
              synthetic=synthetic, quant=quant, threads=threads, peak_bandwidth=peak_bandwidth,
              llama_cpp=llama_cpp, as_json=json_out)


# --- commands registered by other modules ---
app.command("chat")(_attach_sampling(__import__("localllm.cli.repl", fromlist=["_"]).chat_command))
app.command("quantize", no_args_is_help=True)(
    __import__("localllm.cli.quantize", fromlist=["_"]).quantize_command)
app.command("perplexity")(__import__("localllm.cli.perplexity", fromlist=["_"]).perplexity_command)


def main() -> None:
    """Console entry point: maps user errors and signals to one line and an exit code."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        code = app(standalone_mode=False)  # typer returns exit codes (130 for Ctrl-C)
        if isinstance(code, int) and code != 0:
            if code == 130:
                _err("interrupted")
            sys.exit(code)
    except LocalLLMError as e:
        _err(f"error: {e}")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        _err("interrupted")
        sys.exit(130)
    except BrokenPipeError:  # `localllm tokenize ... | head`
        _silence_stdout()
        sys.exit(0)
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Exit):
            sys.exit(e.exit_code)
        if isinstance(e, click.exceptions.Abort):
            sys.exit(130)
        raise


if __name__ == "__main__":
    main()
