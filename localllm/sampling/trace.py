"""The record of one sampling step, shared by the host chain and the device chain."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenTrace:
    """What one sampling step did (``--logprobs N``).

    Attributes:
        token: the chosen token id.
        logprob: its natural-log probability under the raw model distribution (None unless
            ``n_probs`` > 0).
        processed_logprob: its log probability in the distribution it was drawn from (after the
            chain; 0.0 for greedy).
        top: the N most probable tokens of the raw distribution, as (token, logprob), best first.
    """

    token: int
    logprob: float | None
    processed_logprob: float
    top: list[tuple[int, float]]
