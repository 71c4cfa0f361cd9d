"""Sampler and SamplingParams: greedy, seeded reproducibility (per batch, per output position,
across an interruption and resumption elsewhere), top-k / top-p support, the temperature-scaled
distribution, logprobs, and parameter validation."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import CacheConfig, EngineConfig, LLMEngine
from pdserve.engine.sampler import Sampler, apply_top_k_top_p, argmax_rows, draw_seed
from pdserve.engine.sampling_params import SamplingParams

VOCAB = 50
CHI2_DF3_P001 = 16.27  # chi-square critical value, 3 degrees of freedom, p = 0.001


def spread_logits(seed: int = 0, scale: float = 0.5) -> torch.Tensor:
    """One row of logits flat enough that every token is drawn now and then."""
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def draw_many(
    logits_row: torch.Tensor, params: SamplingParams, num_rows: int = 500, num_calls: int = 4
) -> torch.Tensor:
    """num_rows * num_calls draws of one distribution: a batch of rows, each with its own seed."""
    sampler = Sampler()
    logits = logits_row.expand(num_rows, -1).clone()
    seeds = list(range(num_rows))
    draws = [sampler(logits, [params] * num_rows, seeds, [call] * num_rows).token_ids for call in range(num_calls)]
    return torch.tensor(draws).flatten()


def draw_sequence(sampler: Sampler, row: torch.Tensor, params: SamplingParams, positions: range) -> list[int]:
    """One row's draws at consecutive output positions."""
    return [sampler(row[None], [params], [params.seed], [position]).token_ids[0] for position in positions]


def test_greedy_takes_the_argmax():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 3, [0, 1, 2], [0, 0, 0])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None, None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax_with_ties_nan_and_views(dtype):
    values = torch.randn(6, 2 * VOCAB, generator=torch.Generator().manual_seed(3)).to(dtype)
    values[1, 7] = values[1, 30] = values[1].max() + 1  # a tie: the first maximum wins
    values[2, 11] = float("nan")  # NaN counts as the maximum
    values[3] = 0.0
    with torch.inference_mode():
        for rows in (values, values[:, ::2], values[4:5], values[0]):  # views, one row, a vector
            expected = rows.argmax(dim=-1)
            found = argmax_rows(rows)
            assert found.dtype == torch.int64 and found.shape == expected.shape
            assert torch.equal(found, expected)
    assert argmax_rows(values)[1:4].tolist() == [7, 11, 0]


def test_greedy_and_random_rows_mix_in_one_batch():
    logits = torch.stack([spread_logits(1), spread_logits(2)])
    logits[0, 7] = 100.0
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)]
    out = Sampler()(logits, params, [0, 1], [0, 0])
    assert out.token_ids == [7, int(logits[1].argmax())]


def test_seeded_row_draws_the_same_tokens_whatever_shares_its_batch():
    sampler = Sampler()
    row = spread_logits(3)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=3)]

    alone = draw_sequence(sampler, row, seeded, range(20))

    batch = torch.stack([spread_logits(4), row, spread_logits(5)])
    batch_params = [others[0], seeded, others[1]]
    in_batch = [sampler(batch, batch_params, [5, 1234, 6], [7, p, 3 * p]).token_ids[1] for p in range(20)]

    assert in_batch == alone
    assert len(set(alone)) > 5  # really sampling, not a constant


def test_different_seeds_draw_different_tokens():
    sampler = Sampler()
    row = spread_logits(3)
    a = draw_sequence(sampler, row, SamplingParams(seed=1), range(20))
    b = draw_sequence(sampler, row, SamplingParams(seed=2), range(20))
    assert a != b


def test_a_draw_depends_on_the_seed_and_the_position_only():
    """A stream interrupted at position k and resumed by a fresh sampler (another node) draws
    what the uninterrupted one drew; draw seeds of neighbouring seeds and positions all differ."""
    row, seeded, k = spread_logits(11), SamplingParams(seed=99), 7
    uninterrupted = draw_sequence(Sampler(), row, seeded, range(20))
    resumed = draw_sequence(Sampler(), row, seeded, range(k)) + draw_sequence(Sampler(), row, seeded, range(k, 20))
    assert resumed == uninterrupted
    assert len({draw_seed(seed, position) for seed in range(-3, 30) for position in range(30)}) == 33 * 30
    assert draw_seed(-1, 0) == draw_seed(2**64 - 1, 0)  # seeds are 64-bit, negative ones wrap


def test_a_seeded_request_resumed_at_output_k_generates_the_uninterrupted_tokens(tiny_llama_path):
    """The engine-level seam: prompt + the first k outputs, with num_prior_output_tokens = k,
    continues with exactly the tokens the uninterrupted request drew (in another batch, too)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), cache=CacheConfig(block_size=16, num_blocks=64)))
    prompt, seeded, k = list(range(3, 40)), SamplingParams(max_tokens=16, temperature=1.5, seed=7), 5
    (whole,) = engine.generate([prompt], seeded)
    resumed_params = SamplingParams(max_tokens=16 - k, temperature=1.5, seed=7, num_prior_output_tokens=k)
    other = SamplingParams(max_tokens=4, temperature=1.0, seed=8)
    resumed, _ = engine.generate([prompt + whole.token_ids[:k], list(range(100, 130))], [resumed_params, other])
    assert whole.token_ids[:k] + resumed.token_ids == whole.token_ids
    assert len(set(whole.token_ids)) > 5  # really sampling, not a constant


def test_top_k_never_draws_outside_the_k_highest_logits():
    row = spread_logits(6)
    draws = draw_many(row, SamplingParams(top_k=5))
    allowed = set(row.topk(5).indices.tolist())
    assert set(draws.tolist()) == allowed  # all five drawn, nothing else (of 2000 draws)


def test_top_p_never_draws_outside_the_nucleus():
    row = spread_logits(7, scale=1.5)
    probs, ids = torch.softmax(row, -1).sort(descending=True)
    # Smallest prefix of the sorted tokens whose mass reaches 0.5.
    nucleus_size = int((probs.cumsum(-1) < 0.5).sum()) + 1
    nucleus = set(ids[:nucleus_size].tolist())
    assert 2 < nucleus_size < VOCAB // 2

    draws = draw_many(row, SamplingParams(top_p=0.5))
    assert set(draws.tolist()) == nucleus


def test_apply_top_k_top_p_masks_exactly_per_row():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]] * 4))
    params = [
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.65),
        SamplingParams(top_k=3, top_p=0.35),
        SamplingParams(top_k=-1),
    ]
    kept = torch.isfinite(apply_top_k_top_p(logits, params))
    assert kept.tolist() == [
        [False, True, True, True],  # the three largest
        [False, True, False, True],  # 0.4 + 0.3 reaches 0.65
        [False, True, False, False],  # 0.4 alone reaches 0.35
        [True, True, True, True],  # -1 disables top-k
    ]
    assert torch.equal(apply_top_k_top_p(logits, params)[kept], logits[kept])


def test_disabled_top_p_keeps_the_low_probability_tail():
    """A row with top_p=1.0 must keep its whole vocabulary even when another row in the batch
    turns filtering on (otherwise a seeded row's distribution depends on its batch)."""
    logits = torch.tensor([[20.0, 0.0, 0.0, 0.0], [20.0, 0.0, 0.0, 0.0]])
    filtered = apply_top_k_top_p(logits, [SamplingParams(), SamplingParams(top_k=2)])
    assert torch.equal(filtered[0], logits[0])
    assert torch.isfinite(filtered[1]).tolist() == [True, True, False, False]


def test_temperature_sampling_follows_the_scaled_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -1.0])
    temperature = 0.7
    draws = draw_many(logits, SamplingParams(temperature=temperature))
    counts = torch.bincount(draws, minlength=4).double()

    def chi2(expected_probs: torch.Tensor) -> float:
        expected = expected_probs.double() * len(draws)
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(torch.softmax(logits / temperature, -1)) < CHI2_DF3_P001
    assert chi2(torch.softmax(logits, -1)) > CHI2_DF3_P001  # temperature is not ignored


def test_logprobs_of_the_sampled_token_and_top_alternatives():
    logits = torch.stack([spread_logits(8, scale=2.0), spread_logits(9, scale=2.0), spread_logits(10)])
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(logprobs=0), SamplingParams()]
    out = Sampler()(logits, params, [0, 1, 2], [0, 0, 0])
    expected = torch.log_softmax(logits, dim=-1)

    greedy = out.logprobs[0]
    assert greedy.token_id == out.token_ids[0]
    assert greedy.logprob == pytest.approx(expected[0, greedy.token_id].item(), abs=1e-5)
    top_ids = expected[0].topk(3).indices.tolist()
    assert list(greedy.top_logprobs) == top_ids
    assert list(greedy.top_logprobs.values()) == pytest.approx(expected[0, top_ids].tolist(), abs=1e-5)
    assert list(greedy.top_logprobs.values()) == sorted(greedy.top_logprobs.values(), reverse=True)

    sampled = out.logprobs[1]
    assert sampled.logprob == pytest.approx(expected[1, out.token_ids[1]].item(), abs=1e-5)
    assert sampled.top_logprobs == {}
    assert out.logprobs[2] is None


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_tokens=0),
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.01),
        dict(top_k=-2),
        dict(logprobs=-1),
        dict(logprobs=21),
        dict(num_prior_output_tokens=-1),
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_sampling_params_reject_bad_values(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_sampling_params_accept_the_edges():
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, logprobs=0)
    SamplingParams(logprobs=20, top_k=1, top_p=1e-6)
    params = SamplingParams(stop_token_ids=[3, 4])
    assert params.stop_token_ids == (3, 4)
    assert hash(params) == hash(SamplingParams(stop_token_ids=(3, 4)))
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=1e-3).greedy
