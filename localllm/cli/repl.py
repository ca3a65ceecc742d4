"""``localllm chat``: an interactive, streaming chat REPL (prompt-toolkit in, rich out).

Each turn renders the whole conversation with the chat template, keeps the longest common
prefix of the session's KV cache and evaluates only the new tokens, so the cost of a turn
does not grow with the history. When the context fills, the oldest whole messages are
dropped (the system prompt and the messages inside the first ``--keep`` tokens stay) and
what changed is recomputed: llama.cpp's context shift (``tools/main/main.cpp``), done on
message boundaries so the template still sees a well-formed conversation.

:class:`ChatREPL` needs no terminal: :meth:`ChatREPL.handle_line` takes one input line and
output goes to the rich ``Console`` it is given, which is how the tests drive it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import typer

from ..atomic import atomic_output
from ..chat.template import ChatTemplate, apply_chat, template_for
from ..errors import LocalLLMError, ParameterError
from ..runtime.stop import StopMatcher

HELP = """\
/help                 this help
/clear                forget the conversation and its KV cache
/system TEXT          set the system prompt (no TEXT: remove it)
/set PARAM VALUE      set a sampling parameter by its CLI name (/set temp 0.7, /set top-k 20)
/show                 model, template, parameters and context use
/save FILE            save the conversation as JSON
/load FILE            load a conversation saved with /save
/regen                generate the last reply again
/exit                 leave (or Ctrl-D)
Multiline: end a line with \\ to continue it, or put the text between \"\"\" lines.
Ctrl-C stops the reply being generated."""

# CLI spellings that are not simply the field name with '-' for '_'.
_PARAM_ALIASES = {
    "temperature": "temp", "n": "n_predict", "n_predict": "n_predict", "predict": "n_predict",
    "repeat_last_n": "repeat_last_n", "s": "seed",
}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def history_path() -> Path:
    """The input history file, in the user's data directory (platformdirs)."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("localllm")) / "chat_history"


@dataclasses.dataclass
class TurnStats:
    """Figures of the last reply: tokens, seconds, prompt tokens evaluated and reused."""

    generated: int = 0
    seconds: float = 0.0
    prompt_evaluated: int = 0
    prompt_reused: int = 0
    finish: str | None = None
    first_token_seconds: float = 0.0


class ChatREPL:
    """A conversation with a model, driven line by line.

    Args:
        llm: a :class:`localllm.LLM` (or an object with ``tokenizer``, ``metadata``,
            ``session()`` and optionally ``entry``/``path``).
        console: rich Console for all output (default: stdout).
        template: the chat template (default: :func:`template_for` the model).
        params: SamplingParams (default: ``llm.sampling_params()``).
        make_sampler: ``params -> sampler`` with ``sample(logits) -> int`` and
            ``accept(token)`` (default: :func:`localllm.sampling.chain.build_sampler`).
        system: system prompt.
        keep: messages lying within the first ``keep`` tokens of the conversation are never
            dropped by a context shift (the system prompt never is); -1 keeps them all.
        context_shift: False ends a reply that fills the context instead of shifting.
        stop: stop strings.
        n_predict: most tokens per reply (-1: no limit).
    """

    def __init__(
        self,
        llm,
        *,
        console=None,
        template: ChatTemplate | None = None,
        params=None,
        make_sampler: Callable | None = None,
        system: str | None = None,
        keep: int = 0,
        context_shift: bool = True,
        stop: Sequence[str] = (),
        n_predict: int = -1,
        session=None,
    ) -> None:
        if console is None:
            from rich.console import Console

            console = Console(highlight=False)
        if keep < -1:
            raise ParameterError(f"--keep must be >= -1, got {keep}")
        self.llm = llm
        self.console = console
        self.tokenizer = llm.tokenizer
        self.template = template or template_for(llm)
        self.params = params if params is not None else llm.sampling_params()
        if make_sampler is None:
            from ..sampling.chain import build_sampler

            def make_sampler(p):
                return build_sampler(p, llm.tokenizer)

        self.make_sampler = make_sampler
        self.session = session or llm.session()
        self.system = system or None
        self.keep = keep
        self.context_shift = context_shift
        self.stop = tuple(stop)
        self.n_predict = n_predict
        self.messages: list[dict] = []  # the whole history (system prompt apart)
        self.window_start = 0  # messages before it (and after the pinned ones) were shifted out
        self.pinned = 0  # leading messages kept by --keep
        self.stats = TurnStats()
        self._pending: list[str] = []
        self._in_block = False

    # ---- conversation ---------------------------------------------------------------------
    @property
    def ctx_size(self) -> int:
        return self.session.ctx_size

    @property
    def continuing(self) -> bool:
        """True while a multiline input is open (the prompt shows '... ')."""
        return bool(self._pending) or self._in_block

    def window(self) -> list[dict]:
        """The messages the model sees: system, pinned, then the unshifted tail."""
        start = max(self.window_start, self.pinned)
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages[: self.pinned] + self.messages[start:]

    def _encode(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.template.encode(self.tokenizer, messages, add_generation_prompt)

    def clear(self) -> None:
        """Forget the conversation and empty the KV cache."""
        self.messages = []
        self.window_start = self.pinned = 0
        self.session.reset()

    # ---- input ----------------------------------------------------------------------------
    def handle_line(self, line: str) -> bool:
        """Process one line of input; False when the REPL should end.

        A trailing backslash continues the input on the next line; a line starting with
        \"\"\" opens a block that a line ending with \"\"\" closes; a line starting with /
        (outside a block) is a command.
        """
        if self._in_block:
            if line.rstrip().endswith('"""'):
                closing = line.rstrip()[:-3]
                if closing:  # a bare closing line adds no trailing newline
                    self._pending.append(closing)
                self._in_block = False
                return self._submit()
            self._pending.append(line)
            return True
        if not self._pending and line.lstrip().startswith('"""'):
            rest = line.lstrip()[3:]
            if rest.rstrip().endswith('"""'):  # """one line"""
                self._pending.append(rest.rstrip()[:-3])
                return self._submit()
            self._in_block = True
            if rest:
                self._pending.append(rest)
            return True
        if line.endswith("\\"):
            self._pending.append(line[:-1])
            return True
        if not self._pending and line.strip().startswith("/"):
            return self.command(line.strip())
        self._pending.append(line)
        return self._submit()

    def _submit(self) -> bool:
        text, self._pending = "\n".join(self._pending), []
        if text.strip():
            self.send(text)
        return True

    def cancel_input(self) -> None:
        """Drop a half-typed multiline input (Ctrl-C at the prompt)."""
        self._pending, self._in_block = [], False

    # ---- commands -------------------------------------------------------------------------
    def command(self, text: str) -> bool:
        """Run a slash command; False for /exit."""
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        try:
            if name in ("/exit", "/quit", "/bye"):
                return False
            if name in ("/help", "/?"):
                self.console.print(HELP, markup=False, soft_wrap=True)
            elif name == "/clear":
                self.clear()
                self.note("conversation cleared")
            elif name == "/system":
                self.system = arg or None
                self.note("system prompt " + ("set" if arg else "removed"))
            elif name == "/set":
                self.set_param(*arg.split(None, 1)) if arg else self.error("usage: /set PARAM VALUE")
            elif name == "/show":
                self.show()
            elif name == "/save":
                self.save(arg) if arg else self.error("usage: /save FILE")
            elif name == "/load":
                self.load(arg) if arg else self.error("usage: /load FILE")
            elif name == "/regen":
                self.regen()
            else:
                self.error(f"unknown command {name} (try /help)")
        except LocalLLMError as e:
            self.error(str(e))
        except TypeError:
            self.error(f"usage: see /help for {name}")
        return True

    def set_param(self, name: str, value: str) -> None:
        """``/set PARAM VALUE``: PARAM as on the command line (``top-k``, ``--temp``, ``top_k``).

        Raises:
            ParameterError: unknown parameter, a value of the wrong type or out of range.
        """
        key = name.lstrip("-").replace("-", "_").lower()
        key = _PARAM_ALIASES.get(key, _flag_fields().get(key, key))
        if key == "n_predict":
            self.n_predict = _parse_like(-1, value, name)
            self.note(f"n_predict = {self.n_predict}")
            return
        fields = {f.name for f in dataclasses.fields(self.params)}
        if key not in fields:
            raise ParameterError(
                f"/set {name}: unknown parameter (known: {', '.join(sorted(fields))}, n_predict)"
            )
        current = getattr(self.params, key)
        if key in ("samplers", "dry_sequence_breakers") and not value.startswith("["):
            parsed = value  # from_dict splits "top_k;temp" as --samplers does
        else:
            parsed = _parse_like(current, value, name)
        if hasattr(type(self.params), "from_dict"):
            new = type(self.params).from_dict({**dataclasses.asdict(self.params), key: parsed})
        else:
            new = dataclasses.replace(self.params, **{key: parsed})
        if hasattr(new, "validate"):
            new.validate()
        self.params = new
        self.note(f"{key} = {getattr(new, key)!r}")

    def show(self) -> None:
        """Model, template, sampling parameters, context use."""
        llm = self.llm
        entry = getattr(llm, "entry", None)
        name = entry.name if entry is not None else Path(str(getattr(llm, "path", "?"))).name
        lines = [
            f"model      {name} ({getattr(llm, 'path', '?')})",
            f"template   {self.template.name}",
            f"system     {self.system!r}",
            (f"context    {len(self.session.tokens)} / {self.ctx_size} tokens, "
            f"{len(self.window())} of {len(self.messages) + bool(self.system)} messages in view"),
            (f"n_predict  {self.n_predict}   keep {self.keep}   "
            f"context shift {'on' if self.context_shift else 'off'}   stop {list(self.stop)}"),
        ]
        st = self.stats
        lines.append(f"last turn  {st.prompt_evaluated} prompt tokens evaluated, "
                     f"{st.prompt_reused} reused from the cache, first token after "
                     f"{st.first_token_seconds * 1e3:.0f} ms")
        params = dataclasses.asdict(self.params) if dataclasses.is_dataclass(self.params) else {}
        lines.append("sampling   " + " ".join(f"{k}={v!r}" for k, v in params.items()))
        self.console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)

    def save(self, file: str) -> None:
        """Write the conversation as JSON: ``{"messages": [{"role", "content"}, ...]}``."""
        messages = ([{"role": "system", "content": self.system}] if self.system else [])
        data = {"messages": messages + self.messages}
        with atomic_output(Path(file).expanduser(), "/save") as tmp:
            tmp.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n",
                           encoding="utf-8")
        self.note(f"saved {len(data['messages'])} messages to {file}")

    def load(self, file: str) -> None:
        """Replace the conversation by one saved with :meth:`save` (or a bare message list).

        Raises:
            LocalLLMError: unreadable file, bad JSON, or messages without role/content.
        """
        try:
            data = json.loads(Path(file).expanduser().read_text(encoding="utf-8"))
        except OSError as e:
            raise LocalLLMError(f"/load {file}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LocalLLMError(f"/load {file}: not valid JSON: {e}") from None
        messages = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(messages, list):
            raise LocalLLMError(f"/load {file}: expected a list of messages")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
                raise LocalLLMError(f"/load {file}: message {i} needs 'role' and 'content'")
        system = None
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
        self.system = system
        self.messages = [dict(m) for m in messages]
        self.window_start = self.pinned = 0
        # The cache is not reset: the next turn reuses whatever prefix still matches.
        self.note(f"loaded {len(self.messages)} messages from {file}")

    def regen(self) -> None:
        """Drop the last reply and generate it again."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1]["role"] != "user":
            self.error("nothing to regenerate")
            return
        self._reply()

    # ---- output helpers -------------------------------------------------------------------
    def note(self, text: str) -> None:
        self.console.print(text, style="dim", markup=False, highlight=False, soft_wrap=True)

    def error(self, text: str) -> None:
        # soft_wrap: one line even when piped (rich wraps at 80 columns otherwise)
        self.console.print(f"error: {text}", style="red", markup=False, highlight=False,
                           soft_wrap=True)

    def _emit(self, text: str) -> None:
        if text:
            self.console.print(text, end="", markup=False, highlight=False, soft_wrap=True)

    # ---- a turn ---------------------------------------------------------------------------
    def send(self, text: str) -> str | None:
        """Add a user message and stream the reply; returns the reply text (None on error)."""
        self.messages.append({"role": "user", "content": text})
        return self._reply()

    def _fit_prompt(self) -> list[int] | None:
        """Prompt ids of the window, shifting old messages out until it fits with room to
        generate; None (and the user message removed) when it cannot fit."""
        ids = self._encode(self.window())
        while len(ids) + 1 > self.ctx_size:
            if not self.context_shift or not self._drop_oldest():
                last = self.messages.pop()  # the message that does not fit
                n_msg = len(self._encode([last], add_generation_prompt=False))
                if n_msg + 1 > self.ctx_size:
                    self.error(f"the message is {n_msg} tokens; the context holds "
                               f"{self.ctx_size} (raise --ctx-size or shorten it)")
                else:
                    self.error(f"the context is full ({len(ids)} of {self.ctx_size} tokens): "
                               "/clear, or run without --no-context-shift")
                return None
            ids = self._encode(self.window())
        return ids

    def _drop_oldest(self) -> bool:
        """Shift the oldest droppable message out of the window; False when none is left.

        The message being answered (the last user message) is never dropped.
        """
        if self.keep and self.pinned == 0 and self.window_start == 0:
            self.pinned = self._count_pinned()
        start = max(self.window_start, self.pinned)
        last_user = max(i for i, m in enumerate(self.messages) if m["role"] == "user")
        if start >= last_user:
            return False
        self.window_start = start + 1
        # Do not leave the window opening on an assistant/tool turn.
        while (self.window_start < last_user
               and self.messages[self.window_start]["role"] != "user"):
            self.window_start += 1
        return True

    def _count_pinned(self) -> int:
        """How many leading messages end within the first ``keep`` tokens (-1: all but the
        message being answered)."""
        if self.keep < 0:
            return max(0, len(self.messages) - 1)
        head = [{"role": "system", "content": self.system}] if self.system else []
        n = 0
        while n < len(self.messages) - 1:
            if len(self._encode(head + self.messages[: n + 1], False)) > self.keep:
                break
            n += 1
        return n

    def _prefill(self, ids: list[int]):
        """Bring the cache to ``ids`` reusing the common prefix; next-token logits."""
        keep = min(_common_prefix(self.session.tokens, ids), len(ids) - 1)
        self.session.truncate(keep)
        reused = len(self.session.tokens)
        self.stats.prompt_reused += reused
        self.stats.prompt_evaluated += len(ids) - reused
        return self.session.eval(ids[reused:])

    def _reply(self) -> str | None:
        self.stats = stats = TurnStats()
        asked = self.messages[-1]
        try:
            ids = self._fit_prompt()
        except LocalLLMError as e:  # a template error: the message is not kept
            if self.messages and self.messages[-1] is asked:
                self.messages.pop()
            self.error(str(e))
            return None
        if ids is None:
            return None
        from ..tokenizer import StreamDecoder

        tok = self.tokenizer
        sampler = self.make_sampler(self.params)
        decoder = StreamDecoder(tok)
        stopper = StopMatcher(self.stop)
        shown: list[str] = []
        reply_ids: list[int] = []
        t0 = time.perf_counter()
        try:
            logits = self._prefill(ids)
            while True:
                if 0 <= self.n_predict <= len(reply_ids):
                    stats.finish = "length"
                    break
                token = sampler.sample(logits)
                sampler.accept(token)
                if not reply_ids:
                    stats.first_token_seconds = time.perf_counter() - t0
                if token in tok.eog_ids:
                    stats.finish = "eog"
                    break
                reply_ids.append(token)
                piece, stopped = stopper.push(decoder.push(token))
                shown.append(piece)
                self._emit(piece)
                if stopped:
                    stats.finish = "stop"
                    break
                if len(self.session.tokens) + 1 > self.ctx_size:
                    if not self.context_shift:
                        stats.finish = "ctx"
                        break
                    shifted = self._shift_during_reply(ids, reply_ids)
                    if shifted is None:
                        stats.finish = "full"
                        break
                    logits, ids = shifted
                else:
                    logits = self.session.eval([token])
        except KeyboardInterrupt:
            stats.finish = "interrupted"
        if not stopper.stopped:
            tail, _ = stopper.push(decoder.flush())
            tail += stopper.flush()
            shown.append(tail)
            self._emit(tail)
        stats.generated = len(reply_ids)
        stats.seconds = time.perf_counter() - t0
        text = "".join(shown)
        # The partial reply of an interrupted or cut turn is kept: the template closes it.
        self.messages.append({"role": "assistant", "content": text})
        self.console.print()
        if stats.finish == "interrupted":
            self.note("[interrupted]")
        elif stats.finish == "ctx":
            self.note(f"[the context is full ({self.ctx_size} tokens) and --no-context-shift "
                      "is set: reply ended; /clear to start over]")
        elif stats.finish == "full":
            self.note(f"[the context is full ({self.ctx_size} tokens) and no older message is "
                      "left to shift out: reply ended]")
        self._print_stats()
        return text

    def _shift_during_reply(self, prompt_ids: list[int], reply_ids: list[int]):
        """The context is full mid-reply: shift old messages out and recompute.

        Returns (next-token logits, the new prompt ids), or None when nothing can be dropped.
        """
        n_before = len(self.session.tokens)
        target = self.ctx_size * 3 // 4  # leave room to go on after the shift
        ids = prompt_ids
        dropped = 0
        while len(ids) + len(reply_ids) > target and self._drop_oldest():
            dropped += 1
            ids = self._encode(self.window())
        if dropped == 0 or len(ids) + len(reply_ids) + 1 > self.ctx_size:
            return None
        logits = self._prefill(ids + reply_ids)
        self.console.print()
        self.note(f"[context shift: dropped {dropped} oldest message(s), "
                  f"{n_before} -> {len(self.session.tokens)} tokens]")
        return logits, ids

    def _print_stats(self) -> None:
        s = self.stats
        tps = s.generated / s.seconds if s.seconds > 0 else 0.0
        self.note(f"{s.generated} tokens, {tps:.1f} tok/s, context {len(self.session.tokens)}"
                  f"/{self.ctx_size}")

    # ---- terminal loop --------------------------------------------------------------------
    def run(self, *, input=None, output=None, history_file: Path | None = None) -> None:
        """Read lines with prompt-toolkit until /exit or Ctrl-D (plain lines from a pipe).

        Args:
            input / output: prompt-toolkit Input/Output (tests pass a pipe input).
            history_file: input history (default: :func:`history_path`).
        """
        if input is None and not sys.stdin.isatty():
            # Piped input (`echo hi | localllm chat`): plain lines, no prompt or echo.
            for line in sys.stdin:
                if not self.handle_line(line.rstrip("\n")):
                    return
            if self.continuing:
                self._submit()
            return
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        history = InMemoryHistory()
        path = history_file or history_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            history = FileHistory(str(path))
        except OSError:
            pass  # a read-only home: history for this run only
        prompt = PromptSession(history=history, input=input, output=output)
        while True:
            try:
                line = prompt.prompt("... " if self.continuing else ">>> ")
            except KeyboardInterrupt:
                self.cancel_input()
                continue
            except EOFError:
                break
            if not self.handle_line(line):
                break


def _flag_fields() -> dict[str, str]:
    """CLI flag spelling (``repeat_penalty``) -> SamplingParams field (``penalty_repeat``)."""
    try:
        from ..sampling.chain import FLAGS
    except ImportError:
        return {}
    return {flag.lstrip("-").replace("-", "_"): f for f, flag in FLAGS.items()}


def _parse_like(current, value: str, name: str):
    """``value`` converted to the type of ``current``."""
    try:
        if isinstance(current, bool):
            if value.lower() in ("1", "true", "on", "yes"):
                return True
            if value.lower() in ("0", "false", "off", "no"):
                return False
            raise ValueError
        if isinstance(current, int):
            return int(value)
        if isinstance(current, float):
            return float(value)
        if isinstance(current, dict):
            parsed = json.loads(value)  # JSONDecodeError is a ValueError
            return parsed if isinstance(parsed, dict) else {"": parsed}  # from_dict rejects it
        if isinstance(current, (list, tuple)):
            return type(current)(json.loads(value) if value.startswith("[") else [value])
        if current is None:
            try:
                return json.loads(value)
            except json.JSONDecodeError:
                return value
        return value
    except ValueError:
        raise ParameterError(
            f"/set {name}: {value!r} is not a valid {type(current).__name__}"
        ) from None


# ---- the `chat` command ----------------------------------------------------------------------
def chat_command(
    model: Annotated[str | None, typer.Argument(
        help="models.toml name or .gguf path (default: gemma3-270m)")] = None,
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
        "--n-predict", "-n", help="most tokens per reply (-1: no limit)")] = -1,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda")] = "auto",
    threads: Annotated[int | None, typer.Option(
        "--threads", "-t", help="CPU threads (default: physical cores)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="details on stderr")] = False,
    sampling=None,
) -> None:
    """Chat with a model in the terminal (streaming, /help for commands)."""
    from ..cpu.threads import set_threads

    set_threads(threads)
    from rich.console import Console

    from ..api import LLM

    llm = LLM(model, device=device, ctx_size=ctx_size, batch_size=batch_size, verbose=verbose)
    if sampling is None:
        params = llm.sampling_params()
    elif hasattr(sampling, "overrides"):
        params = llm.sampling_params(**sampling.overrides)
    else:
        params = llm.sampling_params(sampling)
    template = template_for(llm, chat_template)
    console = Console(highlight=False)
    repl = ChatREPL(llm, console=console, template=template, params=params, system=system,
                    keep=keep, context_shift=not no_context_shift, stop=stop or (),
                    n_predict=n_predict)
    if verbose:
        console.print(f"model {llm.path}, template {template.name}, device {llm.device}",
                      style="dim", markup=False)
    console.print("/help for commands, Ctrl-D to leave", style="dim", markup=False)
    repl.run()


__all__ = ["ChatREPL", "apply_chat", "chat_command", "history_path"]
