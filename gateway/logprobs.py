"""Token logprobs from the engine, in the two OpenAI formats (legacy completions and chat)."""

from __future__ import annotations

from gateway.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from gateway.tokenizer import Tokenizer
from pdserve.engine.request import TokenLogprob


def completion_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; offsets count from the start
    of the choice's text, advancing by each token's own text (as vLLM does)."""
    result = CompletionLogprobs()
    for entry in logprobs:
        token = tokenizer.token_text(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        result.top_logprobs.append({tokenizer.token_text(t): lp for t, lp in entry.top_logprobs.items()})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **_top_logprob(tokenizer, entry.token_id, entry.logprob).model_dump(),
                top_logprobs=[_top_logprob(tokenizer, t, lp) for t, lp in entry.top_logprobs.items()],
            )
            for entry in logprobs
        ]
    )


def _top_logprob(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    raw = tokenizer.token_bytes(token_id)
    return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw))
