"""Token counts of a response, summed over its choices."""

from __future__ import annotations

from gateway.generation import ChoiceDelta
from gateway.protocol import PromptTokensDetails, Usage


class UsageCounter:
    """Each prompt counts once however many choices it has (n); completions count per choice."""

    def __init__(self, num_prompt_tokens: list[int], num_choices_per_prompt: int) -> None:
        self._num_prompt_tokens = num_prompt_tokens
        self._n = num_choices_per_prompt
        self._num_cached = [0] * len(num_prompt_tokens)
        self.num_completion_tokens = 0

    def add(self, delta: ChoiceDelta) -> None:
        self.num_completion_tokens += delta.num_tokens
        prompt_index = delta.index // self._n
        self._num_cached[prompt_index] = max(self._num_cached[prompt_index], delta.num_cached_tokens)

    def usage(self) -> Usage:
        num_prompt_tokens = sum(self._num_prompt_tokens)
        return Usage(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=self.num_completion_tokens,
            total_tokens=num_prompt_tokens + self.num_completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self._num_cached)),
        )
