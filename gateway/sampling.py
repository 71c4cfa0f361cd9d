"""From an OpenAI request to the backend generations it asks for: one ChoiceSpec per prompt and
choice, each with its SamplingParams and a max_tokens that fits the model's context."""

from __future__ import annotations

from gateway.errors import RequestError
from gateway.generation import ChoiceSpec
from gateway.protocol import SamplingRequest
from pdserve.engine.sampling_params import SamplingParams


def choice_specs(
    request: SamplingRequest,
    response_id: str,
    prompts: list[list[int]],
    *,
    requested_max_tokens: int | None,
    default_max_tokens: int | None,
    max_model_len: int,
    logprobs: int | None,
    prompt_param: str,
) -> list[ChoiceSpec]:
    """Choice `p * n + i` is the i-th sample of prompt p; with a seed, sample i uses seed + i so
    that the n choices differ but the response is reproducible."""
    specs = []
    for p, prompt_token_ids in enumerate(prompts):
        max_tokens = fit_max_tokens(
            requested_max_tokens, default_max_tokens, len(prompt_token_ids), max_model_len, prompt_param
        )
        for i in range(request.n):
            index = p * request.n + i
            params = _sampling_params(request, max_tokens, i, logprobs)
            specs.append(ChoiceSpec(index, f"{response_id}-{index}", prompt_token_ids, params, request.stop_strings))
    return specs


def fit_max_tokens(
    requested: int | None, default: int | None, num_prompt_tokens: int, max_model_len: int, prompt_param: str
) -> int:
    """The request's max_tokens; unset, the default (None: the rest of the context) cut to fit."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{num_prompt_tokens} tokens, leaving no room for the completion. Shorten the prompt.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for the "
            "completion). Shorten the prompt or lower max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


def _sampling_params(
    request: SamplingRequest, max_tokens: int, sample_index: int, logprobs: int | None
) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            seed=None if request.seed is None else request.seed + sample_index,
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
        )
    except ValueError as exc:  # the protocol's bounds should have caught it; still the client's fault
        raise RequestError(str(exc)) from exc
