"""Log-probabilities, penalties and logit bias in the engine (vLLM's and OpenAI's sampling parameters).

The references are the uncached forward of the whole sequence at every step: its log-softmax for `logprobs`, and
for the penalties the plain formulas written out here (repetition as in CTRL / HF, frequency and presence as in
OpenAI's documentation), applied to its logits before the argmax."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model, tiny_config
from helpers import prompts_of_mixed_lengths

from tformer.engine.engine import Engine, EngineConfig
from tformer.engine.sampling import RequestError, SamplingParams, sampling_probs


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_model(tiny_config("tiny-llama"), seed=3)


def forward_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float()  # (T, V)


def test_logprobs_are_the_uncached_forwards_log_softmax(model) -> None:
    """Each token's log-probability and its 4 likeliest alternatives (best first) are the uncached forward's, greedy
    and sampled, for every sample of n = 2; without `logprobs` none come back."""
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)[:3]
    engine = Engine(model, config=EngineConfig(block_size=4))
    for params in (
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=4),
        SamplingParams(max_tokens=6, temperature=0.8, seed=5, n=2, ignore_eos=True, logprobs=4),
    ):
        for completion in engine.generate(prompts, params):
            prompt = completion.prompt_token_ids
            reference = torch.log_softmax(forward_logits(model, prompt + completion.token_ids), -1)
            assert [item.token_id for item in completion.logprobs] == completion.token_ids
            for step, item in enumerate(completion.logprobs):
                row = reference[len(prompt) - 1 + step]
                assert item.logprob == pytest.approx(float(row[item.token_id]), abs=1e-5)
                best = torch.topk(row, 4)
                assert [token for token, _ in item.top] == best.indices.tolist()
                assert [lp for _, lp in item.top] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert engine.generate(prompts[:1], SamplingParams(max_tokens=3))[0].logprobs is None


@pytest.mark.parametrize(
    "engine_config",
    [EngineConfig(block_size=4), EngineConfig(block_size=4, max_batched_tokens=6, pack_prompts=False)],
    ids=["packed", "padded-chunks"],
)
def test_prompt_logprobs_are_the_uncached_forwards(model, engine_config) -> None:
    """vLLM's `prompt_logprobs`: each prompt token after the first, with its 2 likeliest alternatives, equals the
    uncached forward's log-softmax, in whole and chunked prompt steps; the request's first output of sample 0
    carries them. A second run of the same prompts gets them whole too: such a request takes no prefix-cache hits."""
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    engine = Engine(model, config=engine_config)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, n=2, prompt_logprobs=2)
    for _ in range(2):
        for completion in engine.generate(prompts, params):
            if completion.index:
                assert completion.prompt_logprobs is None
                continue
            prompt = completion.prompt_token_ids
            reference = torch.log_softmax(forward_logits(model, prompt), -1)
            assert completion.prompt_logprobs[0] is None and len(completion.prompt_logprobs) == len(prompt)
            for position, item in enumerate(completion.prompt_logprobs[1:], start=1):
                row = reference[position - 1]
                assert item.token_id == prompt[position]
                assert item.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-5)
                assert [token for token, _ in item.top] == torch.topk(row, 2).indices.tolist()
    assert engine.scheduler.prefix_hit_tokens == 0


def test_prompt_logprobs_survive_preemption(model) -> None:
    """A pool too small for every sequence at once: preempted sequences compute their prompts again, and each
    request's prompt log-probabilities still come once per position, the uncached forward's."""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=generator).tolist() for n in (22, 25, 19, 27)]
    engine = Engine(model, config=EngineConfig(block_size=4, num_blocks=24, max_batched_tokens=8))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    results = engine.generate(prompts, params)
    assert engine.num_preemptions > 0
    for completion, prompt in zip(results, prompts, strict=True):
        reference = torch.log_softmax(forward_logits(model, prompt), -1)
        expected = [float(reference[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        assert [item.token_id for item in completion.prompt_logprobs[1:]] == prompt[1:]
        assert [item.logprob for item in completion.prompt_logprobs[1:]] == pytest.approx(expected, abs=1e-5)


def penalized_greedy(model: torch.nn.Module, prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Greedy decoding on the uncached forward, each step's logits adjusted by the plain formulas."""
    ids = list(prompt)
    for _ in range(n):
        logits = forward_logits(model, ids)[-1]
        output = ids[len(prompt) :]
        for token in set(ids):
            value = logits[token]
            penalty = params.repetition_penalty
            logits[token] = value / penalty if value > 0 else value * penalty
        for token in set(output):
            logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
        for token, bias in params.logit_bias.items():
            logits[token] += bias
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    "adjustment",
    [
        dict(repetition_penalty=1.8),
        dict(frequency_penalty=1.5),
        dict(presence_penalty=2.0),
        dict(repetition_penalty=0.7, frequency_penalty=-0.5, logit_bias={3: 0.4, 40: -1.0}),
    ],
    ids=["repetition", "frequency", "presence", "all"],
)
def test_penalties_and_bias_give_the_formulas_tokens(model, adjustment) -> None:
    """Greedy tokens with each adjustment equal the reference's, which differ from the plain greedy ones: the
    adjustment is applied, and applied per sequence in a batch of mixed lengths."""
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **adjustment)
    results = Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)
    expected = [penalized_greedy(model, p, 12, params) for p in prompts]
    assert [r.token_ids for r in results] == expected
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(
        prompts,
        SamplingParams(
            **{
                **vars(params),
                **{"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": {}},
            }
        ),
    )
    assert [r.token_ids for r in plain] != expected


def test_logit_bias_forces_and_bans_tokens(model) -> None:
    """+100 makes a token certain; -100 keeps the otherwise greedy first token out of every sample."""
    prompt = prompts_of_mixed_lengths(model.config.vocab_size)[0]
    engine = Engine(model, config=EngineConfig(block_size=4))
    forced = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=1.0, seed=1, logit_bias={17: 100}))
    assert forced[0].token_ids == [17] * 5
    first = int(forward_logits(model, prompt)[-1].argmax())
    banned = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={first: -100})
    assert first not in engine.generate([prompt], banned)[0].token_ids


def test_a_draft_model_leaves_requests_with_logprobs_or_penalties_to_plain_decoding(model) -> None:
    """With a draft, such requests get no drafts (verifying them would need both per position): the same tokens and
    log-probabilities as without one, and nothing proposed."""
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)[:3]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, frequency_penalty=0.5)
    plain = Engine(model, config=EngineConfig(block_size=4)).generate(prompts, params)
    engine = Engine(model, config=EngineConfig(block_size=4, num_speculative_tokens=3), draft=model)
    drafted = engine.generate(prompts, params)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert [[i.logprob for i in r.logprobs] for r in drafted] == [[i.logprob for i in r.logprobs] for r in plain]
    assert engine.speculative.proposed == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={-3: 1.0}), "logit_bias keys"),
        (dict(logit_bias={3: 101.0}), "logit_bias values"),
        (dict(beam_width=2, logprobs=1), "beam search"),
        (dict(beam_width=2, repetition_penalty=1.2), "beam search"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
    ],
)
def test_bad_sampling_adjustments_are_refused(fields, message) -> None:
    with pytest.raises(RequestError, match=message):
        SamplingParams(**fields)


def test_an_encoder_decoder_refuses_prompt_logprobs() -> None:
    """Its prompt is the source, which it reads and never predicts: a clear error, and nothing queued."""
    engine = Engine(make_model(tiny_config("tiny-transformer")), config=EngineConfig(block_size=4))
    with pytest.raises(RequestError, match="encoder-decoder"):
        engine.add_request([5, 6, 7], SamplingParams(prompt_logprobs=1))
    assert not engine.has_unfinished()
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=1))[0].logprobs is not None


def test_a_logit_bias_outside_the_vocabulary_is_refused(model) -> None:
    engine = Engine(model, config=EngineConfig(block_size=4))
    with pytest.raises(RequestError, match="logit_bias token ids must be in"):
        engine.add_request([1, 2, 3], SamplingParams(logit_bias={model.config.vocab_size: 1.0}))
    assert not engine.has_unfinished()


def test_smollm2_scores_john_1_through_prompt_logprobs(smollm2_pretrained) -> None:
    """Real weights: SmolLM2-135M scores the first 400 tokens of John 1 through `prompt_logprobs` in 128-token
    chunks, as `echo` + `logprobs` ask of the server (lm-evaluation-harness's loglikelihood): each token's
    log-probability within 1e-4 of the uncached forward's, and the same perplexity."""
    from test_interop_gguf import john_1

    model, tokenizer = smollm2_pretrained
    ids = tokenizer.encode(john_1())[:400]
    engine = Engine(model, tokenizer, EngineConfig(max_batched_tokens=128))
    [completion] = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    scored = torch.tensor([item.logprob for item in completion.prompt_logprobs[1:]])
    reference = torch.log_softmax(forward_logits(model, ids)[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert torch.allclose(scored, reference, atol=1e-4, rtol=0)
    assert float(torch.exp(-scored.mean())) == pytest.approx(float(torch.exp(-reference.mean())), rel=1e-5)


def test_min_p_one_keeps_only_the_likeliest_token(model) -> None:
    """min_p = 1 leaves only the likeliest token at every step: sampling at temperature 1 gives the greedy tokens;
    `sampling_probs` with min_p 0.3 zeroes exactly the tokens below 0.3 x the largest probability."""
    prompts = prompts_of_mixed_lengths(model.config.vocab_size)
    engine = Engine(model, config=EngineConfig(block_size=4))
    sampled = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0, seed=2, min_p=1.0))
    greedy = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert [r.token_ids for r in sampled] == [r.token_ids for r in greedy]
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 0.5
    probs = sampling_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    plain = torch.softmax(logits, -1)
    kept = plain >= 0.3 * plain.max()
    assert 1 < int(kept.sum()) < 50 and torch.equal(probs > 0, kept)
    assert torch.allclose(probs[kept], plain[kept] / plain[kept].sum())


def test_min_tokens_holds_back_the_stop_tokens(model) -> None:
    """With the greedy first token as a stop token, the output stops at once; with min_tokens 4 its first 4 tokens
    are the greedy choices with that token banned, then it may stop."""
    prompt = prompts_of_mixed_lengths(model.config.vocab_size)[0]
    first = int(forward_logits(model, prompt)[-1].argmax())
    engine = Engine(model, config=EngineConfig(block_size=4))
    stop = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[first])
    assert engine.generate([prompt], stop)[0].token_ids == [first]
    held = engine.generate([prompt], SamplingParams(**{**vars(stop), "min_tokens": 4}))[0].token_ids
    ids = list(prompt)
    for step in range(len(held)):
        logits = forward_logits(model, ids)[-1]
        if step < 4:
            logits[first] = float("-inf")
        ids.append(int(logits.argmax()))
        if ids[-1] == first:
            break
    assert held == ids[len(prompt) :] and first not in held[:4]
