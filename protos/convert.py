"""Conversions between proto messages and pdserve's own types, used only at servicers and
clients so that proto types stop at the edge. Torch-free (the gateway uses it)."""

from __future__ import annotations

from pdserve.engine.request import TokenLogprob
from pdserve.engine.sampling_params import SamplingParams
from protos import common_pb2


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        num_prior_output_tokens=params.num_prior_output_tokens,
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    return message


def sampling_params_from_proto(message: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError (from SamplingParams) for out-of-range values."""
    return SamplingParams(
        max_tokens=message.max_tokens,
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        num_prior_output_tokens=message.num_prior_output_tokens,
    )


def logprob_to_proto(logprob: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=logprob.token_id, logprob=logprob.logprob, top_logprobs=logprob.top_logprobs
    )


def logprob_from_proto(message: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(message.token_id, message.logprob, dict(message.top_logprobs))
