"""``localllm chat``: an interactive, streaming chat REPL (prompt-toolkit in, rich out).

The conversation itself (messages, KV-cache reuse, the context shift, the decode loop) is
:class:`localllm.chat.conversation.Conversation`; :class:`ChatREPL` adds input lines, slash
commands and printing. While a reply streams, terminal echo is off, so keys typed meanwhile
do not land in the reply's text.

:class:`ChatREPL` needs no terminal: :meth:`ChatREPL.handle_line` takes one input line and
output goes to the rich ``Console`` it is given, which is how the tests drive it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..atomic import atomic_output
from ..chat.conversation import Conversation, TurnStats
from ..errors import LocalLLMError, ParameterError

# A reply's default cap (``-n``): small models that loop are stopped by the loop guard long
# before; this bounds the rest.
DEFAULT_REPLY_TOKENS = 1024

HELP = """\
/help                 this help
/clear                forget the conversation and its KV cache
/system TEXT          set the system prompt (no TEXT: remove it)
/set PARAM VALUE      set a sampling parameter by its CLI name (/set temp 0.7, /set top-k 20)
/show                 model, template, parameters and context use
/save FILE            save the conversation as JSON
/load FILE            load a conversation saved with /save
/regen                generate the last reply again
/think on|off         let a thinking model think (off: no reasoning, where the template allows)
/think show|hide      show the reasoning dimmed, or only a one-line note of its length
/exit                 leave (or Ctrl-D)
Multiline: end a line with \\ to continue it, or put the text between \"\"\" lines.
Ctrl-C stops the reply being generated."""

# CLI spellings that are not simply the field name with '-' for '_'.
_PARAM_ALIASES = {
    "temperature": "temp", "n": "n_predict", "n_predict": "n_predict", "predict": "n_predict",
    "repeat_last_n": "repeat_last_n", "s": "seed",
}


@contextlib.contextmanager
def no_echo(fd: int | None) -> Iterator[None]:
    """Terminal echo and line editing off on ``fd`` for the duration (a reply streaming): keys
    typed meanwhile are not printed into the reply and stay queued for the next prompt.
    Ctrl-C still interrupts (signals stay on). ``fd`` None or not a terminal: no change."""
    old = None
    if fd is not None:
        try:
            import termios

            old = termios.tcgetattr(fd)
        except Exception:  # noqa: BLE001 - no termios (Windows), or not a terminal
            old = None
    if old is None:
        yield
        return
    new = list(old)
    new[3] &= ~(termios.ECHO | termios.ICANON)
    termios.tcsetattr(fd, termios.TCSANOW, new)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, old)


def history_path() -> Path:
    """The input history file, in the user's data directory (platformdirs)."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("localllm")) / "chat_history"


class ChatREPL(Conversation):
    """A :class:`~localllm.chat.conversation.Conversation` driven line by line, printing.

    Args:
        llm, options: see :class:`~localllm.chat.conversation.Conversation` (its keywords).
        n_predict: most tokens per reply (default :data:`DEFAULT_REPLY_TOKENS`; -1: no
            limit).
        console: rich Console for all output (default: stdout).
    Raises:
        ParameterError: see :class:`~localllm.chat.conversation.Conversation`.
    """

    def __init__(self, llm, *, console=None, n_predict: int = DEFAULT_REPLY_TOKENS,
                 **options: Any) -> None:
        if console is None:
            from rich.console import Console

            console = Console(highlight=False)
        super().__init__(llm, n_predict=n_predict, **options)
        self.console = console
        self.show_thinking = True
        self._budget = self.reasoning_budget  # what /think on restores
        self._thought = None  # characters of reasoning shown in this reply (None: none yet)
        self._pending: list[str] = []
        self._in_block = False
        self._echo_fd: int | None = None  # the terminal whose echo is off during replies

    @property
    def continuing(self) -> bool:
        """True while a multiline input is open (the prompt shows '... ')."""
        return bool(self._pending) or self._in_block

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
            elif name == "/think":
                self.think(arg)
            else:
                self.error(f"unknown command {name} (try /help)")
        except LocalLLMError as e:
            self.error(str(e))
        except TypeError:
            self.error(f"usage: see /help for {name}")
        return True

    def think(self, arg: str) -> None:
        """``/think on|off|show|hide``."""
        if arg in ("on", "off"):
            self.variables["enable_thinking"] = arg == "on"
            self.reasoning_budget = self._budget if arg == "on" else 0
            if self.fmt.thinking is None:
                self.note(f"thinking {arg} (this template has no reasoning markers)")
            else:
                self.note(f"thinking {arg}")
        elif arg in ("show", "hide"):
            self.show_thinking = arg == "show"
            self.note(f"reasoning {'shown' if self.show_thinking else 'hidden'}")
        else:
            self.error("usage: /think on|off|show|hide")

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
        self.load_messages(messages)
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
            self._end_thinking()
            self.console.print(text, end="", markup=False, highlight=False, soft_wrap=True)

    def _emit_thinking(self, text: str) -> None:
        """Reasoning: dimmed, or (hidden) one note when it begins and its size when it ends."""
        if not text:
            return
        if self._thought is None:
            self._thought = 0
            if not self.show_thinking:
                self.console.print("thinking...", style="dim", end="", markup=False,
                                   highlight=False)
        self._thought += len(text)
        if self.show_thinking:
            self.console.print(text, style="dim", end="", markup=False, highlight=False,
                               soft_wrap=True)

    def _end_thinking(self) -> None:
        if self._thought is None:
            return
        if self.show_thinking:
            self.console.print()
        else:
            self.console.print(f" ({self._thought} characters; /think show to see them)",
                               style="dim", markup=False, highlight=False)
        self._thought = None

    # ---- a turn ---------------------------------------------------------------------------
    def send(self, text: str) -> str | None:
        """Add a user message and stream the reply; returns the reply text (None on error)."""
        self.messages.append({"role": "user", "content": text})
        return self._reply()

    def _reply(self) -> str | None:
        try:
            with no_echo(self._echo_fd):
                self._thought = None
                text = self.reply(self._emit, self._shifted, self._emit_thinking)
                self._end_thinking()
        except LocalLLMError as e:  # the prompt does not fit, or a template error
            self.error(str(e))
            return None
        self.console.print()
        finish = self.stats.finish
        if finish == "interrupted":
            self.note("[interrupted]")
        elif finish == "ctx":
            self.note(f"[the context is full ({self.ctx_size} tokens) and --no-context-shift "
                      "is set: reply ended; /clear to start over]")
        elif finish == "full":
            self.note(f"[the context is full ({self.ctx_size} tokens) and no older message is "
                      "left to shift out: reply ended]")
        elif finish == "loop":
            self.note("[stopped: the reply kept repeating itself (--no-loop-guard lets it "
                      "go on)]")
        elif finish == "length" and self.n_predict > 0:
            self.note(f"[reply cut at {self.n_predict} tokens: /set n_predict N, or -n, for "
                      "longer replies]")
        self._print_stats()
        return text

    def _shifted(self, dropped: int, before: int, after: int) -> None:
        self.console.print()
        self.note(f"[context shift: dropped {dropped} oldest message(s), "
                  f"{before} -> {after} tokens]")

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
        if input is None and (sys.stdin is None or not sys.stdin.isatty()):
            # Piped input (`echo hi | localllm chat`): plain lines, no prompt or echo; a
            # closed stdin is an empty one.
            for line in sys.stdin or ():
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
        if input is None:  # the real terminal: no echo into the replies
            self._echo_fd = sys.stdin.fileno()
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


__all__ = ["ChatREPL", "TurnStats", "history_path"]
