"""Sampling flags for the command line, defined once and shared by every generating command.

``@sampling_options`` appends llama.cpp's sampling flags (--temp, --top-k, ... --logprobs) to a
typer command's signature and hands the command one ``sampling`` argument: a
:class:`~localllm.sampling.chain.SamplingParams` built from the defaults and the flags the user gave,
whose ``overrides`` attribute holds only those flags (field name -> value), so that they can be
laid over a model's own defaults from models.toml.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import ParameterError
from .options import option_group

if TYPE_CHECKING:  # the sampler chain imports torch: only when a command runs
    from ..sampling.chain import SamplingParams

_PANEL = "Sampling"


def _opt(*names: str, help: str, metavar: str | None = None) -> Any:
    return typer.Option(*names, help=help, metavar=metavar, rich_help_panel=_PANEL,
                        show_default=False)


# (parameter name, field name or None, annotation). Defaults are None = "not given".
_OPTIONS: list[tuple[str, str | None, Any]] = [
    ("temp", "temp", Annotated[float | None, _opt(
        "--temp", help="temperature (default 0.8; <= 0: greedy)")]),
    ("top_k", "top_k", Annotated[int | None, _opt(
        "--top-k", help="top-k sampling (default 40; <= 0: off)")]),
    ("top_p", "top_p", Annotated[float | None, _opt(
        "--top-p", help="top-p (nucleus) sampling in (0, 1] (default 0.95; 1.0: off)")]),
    ("min_p", "min_p", Annotated[float | None, _opt(
        "--min-p", help="min-p sampling in [0, 1] (default 0.05; 0.0: off)")]),
    ("typical", "typ_p", Annotated[float | None, _opt(
        "--typical", help="locally typical sampling p in (0, 1] (default 1.0: off)")]),
    ("repeat_last_n", "penalty_last_n", Annotated[int | None, _opt(
        "--repeat-last-n", help="last N tokens to penalize (default 64; 0: off; -1: ctx size)")]),
    ("repeat_penalty", "penalty_repeat", Annotated[float | None, _opt(
        "--repeat-penalty", help="repetition penalty > 0 (default 1.0: off)")]),
    ("frequency_penalty", "penalty_freq", Annotated[float | None, _opt(
        "--frequency-penalty", help="frequency penalty (default 0.0: off)")]),
    ("presence_penalty", "penalty_present", Annotated[float | None, _opt(
        "--presence-penalty", help="presence penalty (default 0.0: off)")]),
    ("dry_multiplier", "dry_multiplier", Annotated[float | None, _opt(
        "--dry-multiplier", help="DRY multiplier (default 0.0: off)")]),
    ("dry_base", "dry_base", Annotated[float | None, _opt(
        "--dry-base", help="DRY base >= 1 (default 1.75)")]),
    ("dry_allowed_length", "dry_allowed_length", Annotated[int | None, _opt(
        "--dry-allowed-length", help="DRY: repeats longer than this are penalized (default 2)")]),
    ("dry_penalty_last_n", "dry_penalty_last_n", Annotated[int | None, _opt(
        "--dry-penalty-last-n", help="DRY: tokens to scan (default -1: ctx size; 0: off)")]),
    ("dry_sequence_breaker", "dry_sequence_breakers", Annotated[list[str] | None, _opt(
        "--dry-sequence-breaker", metavar="STRING",
        help="DRY sequence breaker (repeatable; replaces the defaults \\n : \" *; "
             "escapes like \\n are processed; 'none': no breakers)")]),
    ("top_n_sigma", "top_n_sigma", Annotated[float | None, _opt(
        "--top-n-sigma", help="top-n-sigma sampling (default -1: off)")]),
    ("xtc_probability", "xtc_probability", Annotated[float | None, _opt(
        "--xtc-probability", help="XTC probability in [0, 1] (default 0.0: off)")]),
    ("xtc_threshold", "xtc_threshold", Annotated[float | None, _opt(
        "--xtc-threshold", help="XTC threshold (default 0.1; > 0.5: off)")]),
    ("dynatemp_range", "dynatemp_range", Annotated[float | None, _opt(
        "--dynatemp-range", help="dynamic temperature range (default 0.0: off)")]),
    ("dynatemp_exp", "dynatemp_exponent", Annotated[float | None, _opt(
        "--dynatemp-exp", help="dynamic temperature exponent (default 1.0)")]),
    ("mirostat", "mirostat", Annotated[int | None, _opt(
        "--mirostat", help="mirostat sampling: 0 off, 1 mirostat, 2 mirostat 2.0 (default 0)")]),
    ("mirostat_lr", "mirostat_eta", Annotated[float | None, _opt(
        "--mirostat-lr", help="mirostat learning rate eta (default 0.1)")]),
    ("mirostat_ent", "mirostat_tau", Annotated[float | None, _opt(
        "--mirostat-ent", help="mirostat target entropy tau (default 5.0)")]),
    ("samplers", None, Annotated[str | None, _opt(
        "--samplers", metavar="NAMES",
        help="';'-separated sampler order (default "
             "penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temperature)")]),
    ("sampling_seq", None, Annotated[str | None, _opt(
        "--sampling-seq", metavar="LETTERS",
        help="sampler order as letters (default edskypmxt)")]),
    ("seed", "seed", Annotated[int | None, _opt(
        "--seed", "-s", help="random seed (default -1: random)")]),
    ("ignore_eos", "ignore_eos", Annotated[bool, _opt(
        "--ignore-eos", help="never stop at an end-of-generation token")]),
    ("logit_bias", None, Annotated[list[str] | None, _opt(
        "--logit-bias", "-l", metavar="ID(+|-)BIAS",
        help="add BIAS to token ID's logit, e.g. 15043+1 or 15043-inf (repeatable)")]),
    ("logprobs", "n_probs", Annotated[int | None, _opt(
        "--logprobs", metavar="N", help="trace each token's log-prob and top N alternatives")]),
]

_LOGIT_BIAS = re.compile(r"\s*(\d+)\s*([+-])\s*(\S+)\s*")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "0": "\0"}


def parse_logit_bias(values: list[str]) -> dict[int, float]:
    """``["15043+1", "2-inf"]`` -> {15043: 1.0, 2: -inf} (later entries for an id add up).

    Raises:
        ParameterError: a malformed entry.
    """
    out: dict[int, float] = {}
    for value in values:
        m = _LOGIT_BIAS.fullmatch(value)
        try:
            if m is None:
                raise ValueError
            bias = float(m.group(3))
            if math.isnan(bias) or bias < 0:  # or a sign inside the number ("1+-2")
                raise ValueError
        except ValueError:
            raise ParameterError(
                f"--logit-bias: {value!r} is not TOKEN_ID(+|-)BIAS, e.g. 15043+1 or 15043-inf"
            ) from None
        tok = int(m.group(1))
        out[tok] = out.get(tok, 0.0) + (-bias if m.group(2) == "-" else bias)
    return out


def unescape(text: str) -> str:
    """Process backslash escapes (\\n, \\t, \\r, \\\\, \\", \\', \\0) as llama.cpp's CLI does."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), text)


def params_from_flags(values: dict[str, Any]) -> SamplingParams:
    """SamplingParams from parsed flag values (parameter name -> value or None if not given).

    The result's ``overrides`` attribute maps field names to the values the user gave.
    Raises:
        ParameterError: an invalid or malformed flag value.
    """
    from ..sampling.chain import SamplingParams, parse_samplers, parse_sampling_seq

    overrides: dict[str, Any] = {}
    for name, field_name, _ in _OPTIONS:
        value = values.get(name)
        if value is None or value is False or field_name is None:
            continue
        overrides[field_name] = value
    if "dry_sequence_breakers" in overrides:
        given = [unescape(v) for v in overrides["dry_sequence_breakers"]]
        overrides["dry_sequence_breakers"] = [] if "none" in given else given
    if values.get("samplers") is not None and values.get("sampling_seq") is not None:
        raise ParameterError("give --samplers or --sampling-seq, not both")
    if values.get("samplers") is not None:
        overrides["samplers"] = parse_samplers(values["samplers"])
    elif values.get("sampling_seq") is not None:
        overrides["samplers"] = parse_sampling_seq(values["sampling_seq"])
    if values.get("logit_bias"):
        overrides["logit_bias"] = parse_logit_bias(values["logit_bias"])
    params = SamplingParams(**overrides)
    params.validate()
    params.overrides = overrides  # type: ignore[attr-defined]
    return params


def sampling_options(func: Callable) -> Callable:
    """Decorator: add every sampling flag to typer command ``func``.

    ``func`` must take a ``sampling`` parameter; it receives a SamplingParams whose
    ``overrides`` dict holds only the flags given on the command line.
    """
    options = [(name, False if name == "ignore_eos" else None, ann) for name, _, ann in _OPTIONS]
    return option_group("sampling", options, params_from_flags)(func)


def describe(params: SamplingParams) -> str:
    """One line of the effective settings (for --verbose), llama.cpp's print() order."""
    d = dataclasses.asdict(params)
    keys = ["penalty_last_n", "penalty_repeat", "penalty_freq", "penalty_present",
            "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n", "top_k",
            "top_p", "min_p", "xtc_probability", "xtc_threshold", "typ_p", "top_n_sigma", "temp",
            "mirostat", "mirostat_eta", "mirostat_tau"]
    return ", ".join(f"{k} = {d[k]}" for k in keys) + f"; samplers: {';'.join(params.samplers)}"


# Our chain step names -> llama.cpp's sampler names (llama_sampler_i::name), for --verbose.
_LLAMA_NAMES = {"logit_bias": "logit-bias", "top_n_sigma": "top-n-sigma", "top_k": "top-k",
                "typ_p": "typical", "top_p": "top-p", "min_p": "min-p",
                "temperature": "temp-ext", "mirostatv2": "mirostat-v2"}


def chain_line(sampler) -> str:
    """The built chain as llama.cpp's ``sampler chain:`` line, e.g. ``logits -> logit-bias ->
    penalties -> ... -> temp-ext -> dist`` (the steps actually in the chain, in order)."""
    names = [n for n, _ in sampler.steps] + [type(sampler.selector).__name__.lower()]
    return " -> ".join(["logits"] + [_LLAMA_NAMES.get(n, n) for n in names])


def show_model_defaults(command) -> None:
    """Add the default model's own sampling defaults (models.toml ``[models.NAME.sampling]``)
    to the ``--help`` of every command with sampling flags, so that help shows what will be
    used: ``temperature (default 0.8; <= 0: greedy; gemma3-270m: 1.0)``. Another MODEL uses its own
    entry; flags given on the command line win over both."""
    from ..errors import LocalLLMError
    from ..registry import load_registry

    try:
        registry = load_registry()
    except LocalLLMError:  # a broken user registry: the command itself will report it
        return
    entry = registry.models.get(registry.default)
    own = dict(entry.sampling) if entry is not None else {}
    by_field = {field: name for name, field, _ in _OPTIONS if field is not None}
    _annotate(command, registry.default, own, by_field)


def _annotate(command, model: str, own: dict, by_field: dict) -> None:
    for sub in getattr(command, "commands", {}).values():
        _annotate(sub, model, own, by_field)
    params = {p.name: p for p in getattr(command, "params", ())}
    if "temp" not in params:  # no sampling flags
        return
    for field, value in own.items():
        p = params.get(by_field.get(field, ""))
        if p is not None and p.help and f"; {model}: " not in p.help:
            mark = f"{model}: {value}"
            p.help = f"{p.help[:-1]}; {mark})" if p.help.endswith(")") else f"{p.help} ({mark})"
    note = (f"Sampling defaults: llama.cpp's, then the model's own from models.toml, section "
            f"models.NAME.sampling ({model}: "
            + (", ".join(f"{k} {v}" for k, v in own.items()) or "none") + "), then the flags.")
    if command.help and "Sampling defaults:" not in command.help:
        command.help = f"{command.help}\n\n{note}"
