"""Turns the last-position logits of each sequence into its next token.

Greedy rows take the argmax. Other rows divide by temperature, keep the top-k and the
smallest top-p nucleus, and draw from what is left. Each draw's randomness is a function of the
request's seed and the output position of the token being drawn, nothing else: a request with a
seed draws the same tokens whatever else shares its batch, after a preemption, and when its
stream resumes on another node (which knows the position from `num_prior_output_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.engine.request import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def argmax_rows(values: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first maximum (int64), as torch's argmax. On the CPU through
    numpy: torch's argmax took 80 us for one row of 49152 logits and 316 us for eight on an AMD
    EPYC Zen 4, numpy's 6 and 27 (docs/benchmarks.md, "twentieth pass"). NaN counts as the maximum
    in both."""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(np.asarray(values.numpy().argmax(axis=-1)))  # a vector's: a 0-d array
    return values.argmax(dim=-1)


class Sampler:
    """Mutates only its scratch generator, which it reseeds before every row it draws."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
    ) -> SamplerOutput:
        """`seeds[i]`: row i's request seed; `positions[i]`: the output index of the token it draws."""
        token_ids = argmax_rows(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            draws = [draw_seed(seeds[i], positions[i]) for i in random_rows]
            token_ids[random_rows] = self._sample(logits[random_rows], [params[i] for i in random_rows], draws)
        ids = token_ids.tolist()
        return SamplerOutput(ids, self._logprobs(logits, ids, params))

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], draw_seeds: list[int]) -> torch.Tensor:
        temperatures = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        logits = logits / temperatures[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = apply_top_k_top_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race: argmax(p / E), E ~ Exp(1), draws index i with probability p_i.
        # E = -log(1 - U) from uniform draws: torch's exponential_ took 0.8 ms per 49k-token
        # row on CPU, uniform_ 0.13 ms (the log runs vectorized over the whole batch).
        uniform = torch.empty_like(probs)
        generator = self._generator(probs.device)
        for row, seed in enumerate(draw_seeds):
            uniform[row].uniform_(generator=generator.manual_seed(seed))
        noise = torch.log1p(-uniform).neg_()
        return argmax_rows(probs / noise)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, token_ids: list[int], params: list[SamplingParams]
    ) -> list[TokenLogprob | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(params)
        if not rows:
            return result
        logprobs = torch.log_softmax(logits[rows], dim=-1)
        max_top = max(params[i].logprobs for i in rows)
        top_values, top_ids = logprobs.topk(max(max_top, 1), dim=-1)
        for row, i in enumerate(rows):
            n = params[i].logprobs
            top = dict(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist()))
            result[i] = TokenLogprob(token_ids[i], logprobs[row, token_ids[i]].item(), top)
        return result


def draw_seed(seed: int, position: int) -> int:
    """The generator seed for output token `position` of a request seeded `seed`: splitmix64
    over both, so that neighbouring seeds and positions give unrelated draws."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ position)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Sets logits outside each row's top-k and top-p nucleus to -inf (at least one token stays)."""
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    remove = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Remove a token when the tokens ranked above it already reach top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    remove = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # top_p 1.0 keeps the float32 tail
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_ids, sorted_logits)
