"""The ``localllm`` command line (typer). Thin: it parses flags and calls the library.

User errors (:class:`localllm.errors.LocalLLMError`) print one ``error:`` line on stderr
and exit 1; Ctrl-C exits 130; SIGTERM exits 143.
"""

from __future__ import annotations

import itertools
import json
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
import typer.main

from ..atomic import read_bounded
from ..errors import LocalLLMError, ParameterError
from . import chat, manage, perplexity, pull, quantize, serve
from .chat_options import ReasoningBudgetOpt, ReasoningFormatOpt, TemplateKwargsOpt
from .options import (
    ThreadsBatchOpt,
    ThreadsOpt,
    apply_threads,
    cache_options,
    prefer_passive_openmp_wait,
    speculative_options,
)
from .terminal import guard_standard_streams, restore_standard_streams, say

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Run quantized GGUF language models locally.",
    context_settings={"help_option_names": ["-h", "--help"]},
)

ModelArg = Annotated[
    str | None, typer.Argument(help="models.toml name, .gguf path or store name "
                               "(hf.co/ORG/REPO:TAG, ollama:NAME ...; default: gemma3-270m)")
]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu or cuda")]
CtxOpt = Annotated[int, typer.Option("--ctx-size", "-c", help="context size in tokens")]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", help="prefill chunk in tokens")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="timings and details on stderr")]


def _err(text: str) -> None:
    say(text)


MAX_PROMPT_BYTES = 64 * 2**20  # a prompt file or stdin (-f /dev/zero would never end)


def read_prompt(prompt: str | None, file: Path | None, name: str = "PROMPT") -> str:
    """The prompt from ``-f FILE``, ``-`` (stdin) or the argument (``name`` in messages).

    Files and stdin are read as bytes, at most :data:`MAX_PROMPT_BYTES`, and must be UTF-8;
    an argument must be too (Python hands invalid bytes in argv over as lone surrogates).

    Raises:
        LocalLLMError: no prompt, an unreadable, oversized or non-UTF-8 file or stream, or an
            empty prompt.
    """
    if file is not None:
        where = f"-f {file}"
        text = _decode_prompt(read_bounded(file, MAX_PROMPT_BYTES, where, "prompt file"), where)
    elif prompt == "-":
        stdin = sys.stdin
        if stdin is None:
            raise LocalLLMError("stdin is closed: nothing to read the prompt from")
        try:
            data = (stdin.buffer.read(MAX_PROMPT_BYTES + 1) if hasattr(stdin, "buffer")
                    else stdin.read(MAX_PROMPT_BYTES + 1))
        except (OSError, ValueError) as e:  # a closed or unreadable descriptor
            raise LocalLLMError(f"stdin: cannot read the prompt: {e}") from None
        text = _decode_prompt(data, "stdin")
    elif prompt is None:
        raise LocalLLMError(f"no {name.lower()}: give {name}, -f FILE, or - to read stdin")
    else:
        text = _decode_prompt(prompt, "the prompt")
    if not text:
        raise LocalLLMError("the prompt is empty")
    return text


def _decode_prompt(data: bytes | str, where: str) -> str:
    if len(data) > MAX_PROMPT_BYTES:
        raise LocalLLMError(f"{where}: longer than {MAX_PROMPT_BYTES >> 20} MiB")
    try:
        if isinstance(data, str):
            data.encode("utf-8")  # lone surrogates: bytes that were not UTF-8
            return data
        return data.decode("utf-8")
    except UnicodeError as e:
        raise LocalLLMError(f"{where}: not valid UTF-8 (byte {e.start})") from None


def print_model_summary(llm) -> None:
    """Model, device, backend and memory on stderr (``--verbose``)."""
    loaded = llm.loaded
    _err(f"model: {llm.path} ({loaded.gguf.architecture}, device {llm.device}, "
         f"backend {loaded.backend})")
    if llm.speculation.enabled:
        _err(f"speculative decoding: {llm.speculation.describe()}")
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
    if "draft_tokens" in t.extra:  # llama.cpp's "draft acceptance rate"
        drafted, accepted = t.extra["draft_tokens"], t.extra["draft_accepted"]
        rate = accepted / drafted if drafted else 0.0
        _err(f"{'draft acceptance':>18} = {rate:10.5f} ({accepted} accepted / {drafted} "
             "generated)")
    from ..cpu.threads import step_threads

    steps = step_threads()
    if steps and min(steps) < max(steps):  # the adaptive count stepped back at some point
        fewer = ", ".join(f"{n} for {steps[n]}" for n in sorted(steps, reverse=True))
        _err(f"{'decode threads':>18} = {fewer} steps (fewer while other processes took the "
             "cores)")
    _err(f"{'finish reason':>18} = {finish_reason}")


# ---- run ----------------------------------------------------------------------------------
def _run(
    args: Annotated[list[str] | None, typer.Argument(
        help="[MODEL] PROMPT  (PROMPT '-' reads stdin)", metavar="[MODEL] PROMPT",
        show_default=False)] = None,
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
    prompt_cache: Annotated[Path | None, typer.Option(
        "--prompt-cache",
        help="file to cache the prompt's KV state in (reused when it matches)")] = None,
    reasoning_format: ReasoningFormatOpt = "auto",
    reasoning_budget: ReasoningBudgetOpt = -1,
    chat_template_kwargs: TemplateKwargsOpt = None,
    threads: ThreadsOpt = None,
    threads_batch: ThreadsBatchOpt = None,
    verbose: VerboseOpt = False,
    sampling=None,
    speculative=None,
    kv_cache=None,
) -> None:
    """Generate a continuation of PROMPT and stream it to stdout. With --chat and a thinking
    model's template, the reasoning goes to stderr (--reasoning-format none: stdout) and a
    grammar or schema applies to the answer after it."""
    apply_threads(threads, threads_batch)
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
    if not chat and (chat_template_kwargs is not None or reasoning_budget != -1):
        raise ParameterError("--chat-template-kwargs and --reasoning-budget apply to the chat "
                             "template: use them with --chat")
    from .chat_options import parse_reasoning_options

    variables, reasoning_format = parse_reasoning_options(reasoning_format, reasoning_budget,
                                                          chat_template_kwargs)
    text = read_prompt(prompt, file)
    if prompt_cache is not None:  # before any work: a device, FIFO or foreign link is refused
        from ..atomic import check_input_file, check_output_path

        check_output_path(prompt_cache, "--prompt-cache")
        if prompt_cache.exists():
            check_input_file(prompt_cache, "--prompt-cache")

    from ..api import LLM

    llm = LLM(model, device=device, ctx_size=ctx_size, batch_size=batch_size, progress=None,
              **(speculative or {}), **(kv_cache or {}))
    params = llm.sampling_params(**(sampling.overrides if sampling is not None else {}))
    if verbose:
        print_model_summary(llm)
    rendered = None
    if chat:
        from ..api.chat import render_chat

        default = llm.entry.system if llm.entry is not None else None
        system = system if system is not None else default
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": text}]
        rendered = render_chat(llm, messages, template=chat_template, variables=variables,
                               files=True)
        ids = rendered.ids
    else:
        ids = llm.encode_prompt(text, special=special)
    constraint = None
    if grammar or grammar_file or json_mode or json_schema:
        from ..grammar.constraint import constraint_from_cli

        constraint = constraint_from_cli(grammar, grammar_file, json_mode, json_schema, llm.tokenizer)
    parser, reasoning_kw = None, {}
    if rendered is not None and rendered.fmt.thinking is not None:
        parser, reasoning_kw = _reasoning_setup(llm, rendered, reasoning_format,
                                                reasoning_budget, constraint)
    json_out = json_mode or json_schema is not None
    session = None
    if prompt_cache is not None:  # llama-cli's --prompt-cache: reuse the matching prefix
        session = llm.session()
        if prompt_cache.is_file():
            session.load(prompt_cache)
    pieces: list[str] = []  # JSON mode prints the value only once it is complete
    finish = None
    out = sys.stdout
    tail = ""  # the last text written, to end the output on a newline where it is due
    steps = llm.stream(ids, params=params, n_predict=n_predict, stop=stop or (),
                       constraint=constraint, session=session, **reasoning_kw)
    thinking_out = _ThinkingOut()
    first = next(steps, None)  # builds the sampler chain and evaluates the prompt
    if verbose:
        print_sampler(steps.sampler)
    try:
        for step in itertools.chain([first] if first is not None else [], steps):
            if params.n_probs > 0 and step.trace is not None:
                print_trace(llm.tokenizer, step.trace)
            answer = step.text
            if parser is not None:
                events = parser.push(step.text) if step.text else []
                if step.finish_reason:
                    events += parser.finish()
                answer = thinking_out.split(events)
            if answer:
                if json_out:
                    pieces.append(answer)
                else:
                    out.write(answer)
                    out.flush()
                    tail = answer
            finish = step.finish_reason
    except BrokenPipeError:  # `localllm run ... | head`: the reader has all it wanted
        _silence_stdout()
        return
    thinking_out.close()
    if session is not None:
        session.truncate(len(ids))  # the prompt's state, as llama-cli saves it
        session.save(prompt_cache)
    if constraint is not None and not constraint.is_accepting():
        raise LocalLLMError(f"generation ended ({finish}) before the grammar was complete")
    if json_out:
        out.write(one_line_json("".join(pieces)) + "\n")
    elif tail and not tail.endswith("\n") and (
            constraint is not None or out.isatty() or (verbose and _same_file(out, sys.stderr))):
        out.write("\n")  # a terminal's prompt, or --verbose's lines, start on their own line
    out.flush()
    if verbose:
        if session is not None:
            reused = steps.timings.reused_tokens
            _err(f"prompt cache: {reused} of {len(ids)} prompt tokens reused")
        print_timings(llm, steps.timings, finish)


def _reasoning_setup(llm, rendered, reasoning_format: str, budget: int, constraint):
    """(the reply parser that splits the reasoning off, or None; the keywords that run the
    reasoning before the constraint and within ``budget``) of a thinking template."""
    from ..api.chat import thinking_spec
    from ..chat.reasoning import single_token
    from ..chat.replies import ReplyParser

    parser = None
    if reasoning_format != "none":
        parser = ReplyParser(rendered.fmt, reasoning=True, inside=rendered.inside)
    kw: dict = {"preserved": [t for text in rendered.fmt.preserved
                              if (t := single_token(llm.tokenizer, text)) is not None]}
    if budget >= 0 or constraint is not None:
        kw["thinking"] = thinking_spec(llm, rendered, budget)
        kw["answer_required"] = constraint is not None
    return parser, kw


class _ThinkingOut:
    """Writes a reply's reasoning to stderr (dimmed on a terminal) and returns its answer."""

    def __init__(self) -> None:
        self.open = False
        self.dim = sys.stderr.isatty()

    def split(self, events) -> str:
        answer = []
        for e in events:
            if e.kind == "reasoning" and e.text:
                if not self.open:
                    self.open = True
                    sys.stderr.write("\x1b[2m" if self.dim else "")
                sys.stderr.write(e.text)
                sys.stderr.flush()
            elif e.kind in ("content", "drop") and e.text:
                self.close()
                answer.append(e.text)
        return "".join(answer)

    def close(self) -> None:
        if self.open:
            sys.stderr.write("\x1b[0m\n" if self.dim else "\n")
            sys.stderr.flush()
            self.open = False


def _same_file(a, b) -> bool:
    """True when streams ``a`` and ``b`` write to the same file or terminal (``2>&1``)."""
    import os

    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, OSError, ValueError):  # not a real file (tests' capture)
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def print_sampler(sampler) -> None:
    """llama.cpp's ``sampler seed / params / chain`` lines on stderr (``--verbose``)."""
    from .sampling import chain_line, describe

    _err(f"sampler seed: {sampler.seed}")
    _err(f"sampler params: {describe(sampler.params)}")
    _err(f"sampler chain: {chain_line(sampler)}")


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


app.command("run")(_attach_sampling(speculative_options(cache_options(_run))))


# ---- info / tokenize / models -------------------------------------------------------------
@app.command()
@cache_options
def info(model: ModelArg = None, kv_cache=None) -> None:
    """Architecture, hyperparameters, tokenizer and a per-type tensor table; the memory of a
    sequence with the -ctk / -ctv cache types (default f16)."""
    from ..memory import cache_type
    from .info import print_info

    kv = kv_cache or {}
    print_info(model, types=(cache_type(kv.get("type_k", "f16")),
                             cache_type(kv.get("type_v", "f16"))))


@app.command()
def tokenize(
    model: ModelArg = None,
    text: Annotated[str | None, typer.Argument(help="text to tokenize ('-' reads stdin)")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="read the text from FILE")] = None,
    no_bos: Annotated[bool, typer.Option("--no-bos", help="do not add BOS")] = False,
    special: Annotated[bool, typer.Option("--special", help="parse special-token text")] = False,
    pieces: Annotated[bool, typer.Option("--pieces", help="print id and piece per line")] = False,
) -> None:
    """Print the token ids of TEXT."""
    if file is not None:
        if text is not None:
            raise ParameterError("give TEXT or -f FILE, not both")
    elif text is None:  # one argument: it is the text, for the default model
        model, text = None, model
    text = read_prompt(text, file, "TEXT") if text != "" or file is not None else ""
    from ..gguf.file import open_gguf
    from ..gguf.validate import validate_vocab
    from ..registry import load_registry
    from ..tokenizer import Tokenizer

    path, _ = load_registry().resolve(model)
    metadata = open_gguf(path).metadata
    validate_vocab(metadata, path.name)  # the checks `run` makes before loading
    tok = Tokenizer(metadata)  # no weights needed
    ids = tok.encode(text, add_bos=not no_bos and tok.add_bos, special=special)
    try:  # flushed here: click would turn a closed pipe into exit status 1
        if pieces:
            for i in ids:
                print(f"{i:>8} {tok.token_text(i)!r}")
        else:
            print(ids)
        sys.stdout.flush()
    except BrokenPipeError:  # `localllm tokenize ... | head`: the reader has all it wanted
        _silence_stdout()


@app.command()
def models() -> None:
    """List the models of models.toml (present or pulled, size, where) and those Hugging
    Face's cache, Ollama, llama.cpp and LM Studio keep on this machine."""
    from .pull import print_models

    print_models()


@app.command()
@speculative_options
@cache_options
def bench(
    model: ModelArg = None,
    n_prompt: Annotated[int, typer.Option("--n-prompt", "-p", help="prompt tokens (pp)")] = 512,
    n_gen: Annotated[int, typer.Option("--n-gen", "-n", help="generated tokens (tg)")] = 128,
    repetitions: Annotated[int, typer.Option("--repetitions", "-r")] = 3,
    device: DeviceOpt = "auto",
    synthetic: Annotated[str | None, typer.Option(
        "--synthetic", help="random weights of a real geometry: llama3-8b, llama3.2-1b, "
        "mistral-7b, qwen2.5-7b, qwen3-8b, qwen3-30b-a3b, gemma2-9b, phi3-mini, olmo2-7b, "
        "granite3-8b ... (localllm.models.geometries.GEOMETRIES)")] = None,
    quant: Annotated[str, typer.Option(
        "--quant", help="recipe of --synthetic (Q4_K_M, Q8_0 ...)")] = "Q4_K_M",
    threads: ThreadsOpt = None,
    threads_batch: ThreadsBatchOpt = None,
    peak_bandwidth: Annotated[float | None, typer.Option(
        "--peak-bandwidth", help="device peak memory bandwidth in GB/s (for MBU)")] = None,
    llama_cpp: Annotated[bool, typer.Option(
        "--llama-cpp/--no-llama-cpp", help="also time llama-cpp-python when installed")] = True,
    json_out: Annotated[bool, typer.Option(
        "--json", help="print the figures as one JSON line")] = False,
    kv_cache=None,
    speculative=None,
) -> None:
    """Prefill (pp) and decode (tg) speed, time to first token, peak memory and bandwidth;
    with a speculative-decoding flag, the decode speed with guessing too."""
    from .progress import step_progress

    threads = apply_threads(threads, threads_batch)

    with step_progress("starting") as report:
        from ..eval.bench import run_bench

        figures = run_bench(model, n_prompt=n_prompt, n_gen=n_gen, repetitions=repetitions,
                            device=device, synthetic=synthetic, quant=quant, threads=threads,
                            threads_batch=threads_batch,
                            peak_bandwidth=peak_bandwidth, llama_cpp=llama_cpp, as_json=True,
                            progress=report, print_result=False, kv_cache=kv_cache,
                            speculative=speculative)
    from ..eval.bench import print_figures

    if json_out:
        print(json.dumps(figures), flush=True)
    else:
        print_figures(figures)


# --- commands defined in their own modules ---
app.command("chat")(_attach_sampling(speculative_options(cache_options(chat.chat_command))))
app.command("quantize")(quantize.quantize_command)
app.command("perplexity")(cache_options(perplexity.perplexity_command))
app.command("pull")(pull.pull_command)
app.command("rm")(pull.rm_command)
app.command("serve")(speculative_options(cache_options(serve.serve_command)))
app.command("show")(manage.show_command)
app.command("create")(manage.create_command)
app.command("cp")(manage.cp_command)
app.command("ps")(manage.ps_command)


def _click_exceptions() -> list:
    """The exception modules of every click in use: typer >= 0.28 vendors its own copy as
    ``typer._click``, older typer uses the ``click`` package (both may be installed)."""
    import importlib

    found = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            pass
    return found


def _usage_error_line(e) -> str:
    """A click usage error (unknown flag, bad or missing value) as one ``error:`` line."""
    ctx = getattr(e, "ctx", None)
    where = f"{ctx.command_path}: " if ctx is not None and ctx.command_path else ""
    message = " ".join(line.strip() for line in e.format_message().splitlines() if line.strip())
    hint = f" (see {ctx.command_path} --help)" if ctx is not None and ctx.command_path else ""
    return f"error: {where}{message}{hint}"


def _plain_metavars(command, settings: dict | None = None) -> None:
    """Help without type tags (``<bool>``, ``<int>``): flags show none, values show llama.cpp's
    metavars (``N``, ``FILE``, ``TEXT``). Options that name their own metavar keep it."""
    settings = {**(settings or {}), **(command.context_settings or {})}
    for sub in getattr(command, "commands", {}).values():
        _plain_metavars(sub, settings)
    params = list(getattr(command, "params", ()))
    try:  # click >= 8.2 / typer._click build --help once per command and cache it
        params.append(command.get_help_option(command.context_class(command, **settings)))
    except Exception:  # noqa: BLE001, S110 - older click: --help shows no type anyway
        pass
    for p in params:
        if p is None:
            continue
        if p.param_type_name == "argument" and hasattr(p, "display_type_rich"):
            p.display_type_rich = lambda ctx: None  # typer >= 0.28: the name column says it
        if p.metavar is not None:
            continue
        if getattr(p, "is_flag", False) or getattr(p, "count", False):
            p.metavar = ""
            continue
        kind = getattr(getattr(p, "type", None), "name", None)
        desc = getattr(p, "type_descriptor", None)  # typer >= 0.28 keeps the annotation
        text = str(getattr(desc, "annotation", "")) if desc is not None else str(kind)
        if p.param_type_name == "argument":
            p.metavar = p.name.upper()
        elif "int" in text or "float" in text:
            p.metavar = "N"
        elif "path" in text.lower():
            p.metavar = "FILE"
        else:
            p.metavar = "TEXT"


# Signals whose default action kills the process at once: turned into SystemExit so that
# cleanup runs (a half-written output file is removed). Ignored signals (nohup) stay ignored.
_EXIT_SIGNALS = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM")


def _exit_on_signals() -> None:
    for name in _EXIT_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))


def main(args: list[str] | None = None) -> None:
    """Console entry point: maps user errors and signals to one line and an exit code.

    Exit status: 0 success (and ``--help``, or ``localllm`` alone, which prints the help);
    1 any user error, usage errors included (unknown flag, a bad or missing value, a
    command without its arguments: one ``error:`` line naming the command and the flag,
    never a traceback); 130 Ctrl-C; 128 + the signal's number for SIGTERM (143), SIGHUP,
    SIGUSR1/2, SIGALRM. Error lines show control characters escaped. A standard stream
    closed at start-up reads as ``/dev/null``; diagnostics that stderr cannot take (closed,
    full) are dropped without changing the exit status. On a machine whose cores are busy
    at start, idle OpenMP threads sleep instead of spinning unless ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` says otherwise (:func:`localllm.cli.options.prefer_passive_openmp_wait`).
    """
    _exit_on_signals()
    prefer_passive_openmp_wait()  # before torch is imported
    saved = guard_standard_streams()
    try:
        _main(args)
    finally:
        restore_standard_streams(saved)


def _main(args: list[str] | None) -> None:
    click_errors = _click_exceptions()

    def classes(name: str) -> tuple:
        return tuple(getattr(m, name) for m in click_errors if hasattr(m, name))

    usage_errors = classes("ClickException")
    exits = (typer.Exit, *classes("Exit"))  # typer >= 0.28 has its own Exit and Abort
    aborts = (typer.Abort, *classes("Abort"))
    no_args = classes("NoArgsIsHelpError")
    try:
        command = typer.main.get_command(app)
        _plain_metavars(command)
        from .sampling import show_model_defaults

        show_model_defaults(command)
        code = command.main(args=args, prog_name="localllm", standalone_mode=False)
        if isinstance(code, int) and code != 0:  # typer returns exit codes (130 for Ctrl-C)
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
    except no_args as e:  # `localllm` alone: the help (typer's rich help is already printed)
        text = e.format_message()
        if text.strip():
            print(text)
        sys.exit(0)
    except usage_errors as e:
        _err(_usage_error_line(e))
        sys.exit(1)
    except exits as e:
        sys.exit(e.exit_code)
    except aborts:
        _err("interrupted")
        sys.exit(130)
    except OSError as e:  # stdout on a full disk (ENOSPC), an I/O error writing output
        _err(f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
        _silence_stdout()
        sys.exit(1)


if __name__ == "__main__":
    main()
