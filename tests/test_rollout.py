"""Rollout: keyed sampling statistics, the built-in engine's batch independence, custom rollouts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from runtime.errors import ConfigError
from runtime.rollout import (
    BuiltinEngine,
    SampleRequest,
    SampleResult,
    SamplingParams,
    default_rollout,
    load_custom_rollout,
    turn_key,
    validate_rollout_output,
)
from runtime.rollout.keyed_sampling import filter_logits, sample_key_hash, sample_next, uniform_noise


@pytest.fixture(scope="module", autouse=True)
def single_cpu_thread():
    # The tiny model's matmuls are microseconds; with intra-op threads on a busy 2-core box they
    # spend 10-50x longer waiting on each other. Restored afterwards for the rest of the suite.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# keyed sampling
# ---------------------------------------------------------------------------------------------

_U64 = (1 << 64) - 1


def _reference_mix(z: int) -> int:
    """splitmix64's finaliser on Python ints (true uint64 arithmetic), to check the int64 emulation."""
    z &= _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _reference_key_hash(key: tuple[int, int, int, int]) -> int:
    state = 0x2545F4914F6CDD1D
    for column, component in enumerate(key):
        state = _reference_mix(state ^ _reference_mix(component + (column + 1) * 0x9E3779B97F4A7C15))
    return state


def _reference_uniform(key_hash: int, position: int, v: int) -> float:
    row_state = _reference_mix(key_hash ^ _reference_mix(position + 0xD6E8FEB86659FD93))
    bits = _reference_mix(row_state + (v + 1) * 0x9E3779B97F4A7C15)
    return ((bits >> 41) * 2 + 1) / 2.0**24


def _keys(n: int, seed: int = 7, rollout_id: int = 3, prompt_index: int = 0) -> torch.Tensor:
    return torch.tensor([[seed, rollout_id, prompt_index, j] for j in range(n)], dtype=torch.long)


def test_int64_hash_is_bit_identical_to_uint64_splitmix():
    keys = [(0, 0, 0, 0), (1234, 5, 17, 3), (-1, 2**62, 7, 2**40), (2**63 - 1, -(2**63), 0, 1)]
    hashes = sample_key_hash(torch.tensor(keys, dtype=torch.long))
    for key, h in zip(keys, hashes.tolist()):
        assert h & _U64 == _reference_key_hash(key)
    positions = torch.tensor([0, 5, 100, 2**31], dtype=torch.long)
    noise = uniform_noise(hashes, positions, 50)
    for row, (h, pos) in enumerate(zip(hashes.tolist(), positions.tolist())):
        for v in (0, 1, 49):
            assert noise[row, v].item() == _reference_uniform(h & _U64, pos, v)


def test_uniform_noise_is_uniform_in_open_interval():
    key_hash = sample_key_hash(_keys(64))
    noise = uniform_noise(key_hash, torch.arange(64), 4096).flatten().double()
    n = noise.numel()
    assert 0.0 < noise.min().item() and noise.max().item() < 1.0
    assert abs(noise.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / n)  # 4 sigma
    assert abs(noise.var().item() - 1 / 12) < 0.002
    # Kolmogorov-Smirnov distance to U(0,1); 1.95/sqrt(n) is the 0.1% critical value.
    sorted_noise = noise.sort().values
    ecdf_hi = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = torch.maximum(ecdf_hi - sorted_noise, sorted_noise - (ecdf_hi - 1 / n)).max().item()
    assert ks < 1.95 / math.sqrt(n)
    # Neighbouring vocab entries and neighbouring sample indices must not be correlated.
    grid = noise.view(64, 4096) - 0.5
    assert abs((grid[:, 1:] * grid[:, :-1]).mean().item()) < 0.002
    assert abs((grid[1:] * grid[:-1]).mean().item()) < 0.002


def test_noise_depends_only_on_key_and_position():
    key_hash = sample_key_hash(_keys(8))
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    together = uniform_noise(key_hash, positions, 100)
    for row in range(8):
        alone = uniform_noise(key_hash[row : row + 1], positions[row : row + 1], 100)
        assert torch.equal(alone[0], together[row])
    assert not torch.equal(together[0], together[4])  # same position, other sample index
    other_position = uniform_noise(key_hash[:1], torch.tensor([1]), 100)
    assert not torch.equal(other_position[0], together[0])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return (((counts - expected) ** 2) / expected).sum().item()


# chi-square critical values at p = 0.001 for 7 and 2 degrees of freedom
_CHI2_CRIT = {7: 24.32, 2: 13.82}


def test_sampling_frequencies_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    sampling = SamplingParams(temperature=0.7)
    n = 40_000
    tokens, logprobs = sample_next(logits.expand(n, -1), sample_key_hash(_keys(n)), torch.zeros(n, dtype=torch.long), sampling)
    probs = torch.softmax(logits / 0.7, dim=-1)
    counts = torch.bincount(tokens, minlength=8).double()
    assert _chi_square(counts, probs.double()) < _CHI2_CRIT[7]
    assert torch.allclose(logprobs, torch.log(probs)[tokens], atol=1e-6)


def test_top_k_and_top_p_never_emit_filtered_tokens():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 20_000
    key_hash, position = sample_key_hash(_keys(n, seed=11)), torch.full((n,), 3, dtype=torch.long)
    batch_logits = logits.expand(n, -1)
    full_logprobs = torch.log_softmax(logits, dim=-1)

    tokens, logprobs = sample_next(batch_logits, key_hash, position, SamplingParams(top_k=3))
    top3 = [0, 6, 1]
    assert set(tokens.unique().tolist()) == set(top3)
    renormalised = torch.softmax(logits[top3].double(), dim=-1)
    assert _chi_square(torch.bincount(tokens, minlength=8)[top3].double(), renormalised) < _CHI2_CRIT[2]
    # The log-prob is under the unfiltered distribution (what the trainer recomputes).
    assert torch.allclose(logprobs, full_logprobs[tokens], atol=1e-6)

    # top_p: probs sorted are ~[.33, .20, .12, .10, ...]; the nucleus for 0.6 is {0, 6, 1, 2}.
    probs = torch.softmax(logits, dim=-1)
    nucleus = filter_logits(logits[None], -1, 0.6)[0].isfinite().nonzero().flatten().tolist()
    sorted_probs, order = probs.sort(descending=True)
    k = int((sorted_probs.cumsum(0) < 0.6).sum().item()) + 1
    assert sorted(nucleus) == sorted(order[:k].tolist())
    tokens, _ = sample_next(batch_logits, key_hash, position, SamplingParams(top_p=0.6))
    assert set(tokens.unique().tolist()) == set(nucleus)

    # top-k first, then top-p on the renormalised top-k mass ({.42, .26, .16, .09, .07}).
    tokens, _ = sample_next(batch_logits, key_hash, position, SamplingParams(top_k=5, top_p=0.5))
    assert set(tokens.unique().tolist()) == {0, 6}
    tokens, _ = sample_next(batch_logits, key_hash, position, SamplingParams(top_p=1e-6))
    assert tokens.unique().tolist() == [0]  # the best token always survives


def test_greedy_temperature_zero():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = sample_next(logits, sample_key_hash(_keys(5)), torch.zeros(5, dtype=torch.long), SamplingParams(temperature=0))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, torch.log_softmax(logits, -1).max(-1).values)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1.0}, "rollout.temperature"),
        ({"temperature": float("nan")}, "rollout.temperature"),
        ({"top_p": 0.0}, "rollout.top_p"),
        ({"top_p": 1.5}, "rollout.top_p"),
        ({"top_k": 0}, "rollout.top_k"),
        ({"max_new_tokens": 0}, "rollout.max_new_tokens"),
        ({"stop_token_ids": [-3]}, "rollout.stop_token_ids"),
    ],
)
def test_bad_sampling_params_raise_config_error(kwargs, field):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    assert field in str(info.value) and "\n" not in str(info.value)


def test_bad_request_key_is_rejected():
    with pytest.raises(ValueError):
        SampleRequest(prompt_ids=[1, 2], key=(1, 2, 3))
    with pytest.raises(ValueError):
        SampleRequest(prompt_ids=[1, 2], key=(1, 2, 3, 2**63))
    assert SampleRequest(prompt_ids=[1], key=(torch.tensor(1), 2, 3, 4)).key == (1, 2, 3, 4)


# ---------------------------------------------------------------------------------------------
# built-in engine on a tiny random Qwen3
# ---------------------------------------------------------------------------------------------

_CORPUS = [
    "what is two plus three ? the answer is five .",
    "compute 12 + 7 = 19 and 3 * 4 = 12 , so the total is 31",
    "hello world , the quick brown fox jumps over the lazy dog",
    "a tool returned : the answer is 42",
]


def _build_tiny_model(directory) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer.train_from_iterator(_CORPUS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    config = Qwen3Config(
        vocab_size=128,  # larger than the tokenizer, as in real Qwen checkpoints
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(1234)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_qwen3")
    _build_tiny_model(directory)
    return str(directory)


@pytest.fixture(scope="module")
def engine(model_dir):
    return BuiltinEngine(model_dir)


def _requests(engine: BuiltinEngine, samples_per_prompt: int = 3, rollout_id: int = 0) -> list[SampleRequest]:
    texts = ["what is two plus three ?", "hello", "compute 12 + 7 = 19 and 3 * 4", "the quick brown fox jumps"]
    return [
        SampleRequest(prompt_ids=engine.tokenizer.encode(text), key=(42, rollout_id, p, s))
        for p, text in enumerate(texts)
        for s in range(samples_per_prompt)
    ]


def _assert_same_samples(a: list[SampleResult], b: list[SampleResult], atol: float = 1e-5) -> float:
    """Tokens must match exactly; returns the largest log-prob difference (asserted <= atol)."""
    assert len(a) == len(b)
    worst = 0.0
    for x, y in zip(a, b):
        assert x.response_ids == y.response_ids and x.finish_reason == y.finish_reason and x.text == y.text
        worst = max([worst] + [abs(p - q) for p, q in zip(x.response_logprobs, y.response_logprobs)])
    assert worst <= atol
    return worst


def test_generation_is_independent_of_batch_composition(engine, model_dir):
    requests = _requests(engine)
    sampling = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=12, stop_token_ids=[5])
    one_batch = engine.generate(requests, sampling)
    reversed_batch = engine.generate(requests[::-1], sampling)[::-1]
    singles = [engine.generate([r], sampling)[0] for r in requests]
    chunked_by_engine = BuiltinEngine(model_dir, max_batch_size=5).generate(requests, sampling)
    interleaved = requests[0::2] + requests[1::2]
    by_interleaving = engine.generate(interleaved, sampling)
    regrouped = [None] * len(requests)
    regrouped[0::2], regrouped[1::2] = by_interleaving[: len(requests[0::2])], by_interleaving[len(requests[0::2]) :]

    worst = max(
        _assert_same_samples(one_batch, other)
        for other in (reversed_batch, singles, chunked_by_engine, regrouped)
    )
    # Not bitwise: CPU GEMM/attention blocking depends on the batch's rows and padded width, so
    # log-probs move by ~1 ulp (<= 1e-6 seen). The tokens must match regardless.
    print(f"largest log-prob difference across batchings: {worst:.3g}")
    assert {r.finish_reason for r in one_batch} == {"stop", "length"}, "test wants both finish kinds"


def test_same_keys_same_output_and_sample_index_matters(engine):
    requests = _requests(engine, samples_per_prompt=4)
    sampling = SamplingParams(max_new_tokens=10)
    first, second = engine.generate(requests, sampling), engine.generate(requests, sampling)
    assert _assert_same_samples(first, second, atol=0.0) == 0.0
    for p in range(4):
        responses = {tuple(r.response_ids) for r in first[4 * p : 4 * p + 4]}
        assert len(responses) == 4, "samples of one prompt must differ"
    later_rollout = engine.generate(_requests(engine, samples_per_prompt=4, rollout_id=1), sampling)
    assert [r.response_ids for r in later_rollout] != [r.response_ids for r in first]


def test_finish_reason_is_consistent_with_stop_tokens(engine):
    stop_ids = list(range(10, 40))
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=stop_ids)
    stops = set(stop_ids) | engine.eos_token_ids
    results = engine.generate(_requests(engine, samples_per_prompt=6), sampling)
    for result in results:
        assert len(result.response_ids) == len(result.response_logprobs)
        assert not stops & set(result.response_ids[:-1]), "nothing may follow a stop token"
        if result.finish_reason == "stop":
            assert result.response_ids[-1] in stops  # the stop token is kept, with its log-prob
        else:
            assert result.finish_reason == "length" and len(result.response_ids) == 8
            assert result.response_ids[-1] not in stops
    assert {r.finish_reason for r in results} == {"stop", "length"}


def test_logprobs_match_teacher_forcing(engine):
    for sampling in (SamplingParams(max_new_tokens=10), SamplingParams(temperature=0.6, top_k=20, max_new_tokens=10)):
        for result in engine.generate(_requests(engine, samples_per_prompt=2), sampling):
            forced = engine.logprobs_of(result.prompt_ids, result.response_ids, temperature=sampling.temperature)
            assert max(abs(a - b) for a, b in zip(result.response_logprobs, forced)) < 1e-5


def test_greedy_matches_argmax_of_teacher_forcing(engine):
    sampling = SamplingParams(temperature=0.0, max_new_tokens=6)
    results = engine.generate(_requests(engine, samples_per_prompt=2), sampling)
    for a, b in zip(results[0::2], results[1::2]):
        assert a.response_ids == b.response_ids  # greedy ignores the key
    for result in results[0::2]:
        ids = torch.tensor([result.prompt_ids + result.response_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0]
        predicted = logits[len(result.prompt_ids) - 1 : -1].argmax(-1).tolist()
        assert predicted == result.response_ids


def test_update_weights_changes_outputs_and_version(model_dir):
    engine = BuiltinEngine(model_dir)
    requests = _requests(engine, samples_per_prompt=2)
    sampling = SamplingParams(max_new_tokens=6)
    before = engine.generate(requests, sampling)
    state = engine.model.state_dict()
    eos = engine.tokenizer.eos_token_id

    # Make eos certain: every embedding gets a large constant in dimension 0, which survives two
    # small random layers and the final RMSNorm; only eos's lm_head row reads that dimension.
    embed = state["model.embed_tokens.weight"].clone()
    embed[:, 0] = 100.0
    head = state["lm_head.weight"].clone()
    head[eos, 0] = 10.0
    engine.update_weights({"model.embed_tokens.weight": embed, "lm_head.weight": head}, version=3)
    assert engine.weight_version == 3 and engine.health()["weight_version"] == 3
    after = engine.generate(requests, sampling)
    assert [r.response_ids for r in after] != [r.response_ids for r in before]
    for result in after:
        assert result.response_ids == [eos] and result.finish_reason == "stop" and result.text == ""
        assert result.response_logprobs[0] > -1e-3
        assert engine.logprobs_of(result.prompt_ids, result.response_ids) == pytest.approx(result.response_logprobs, abs=1e-5)

    with pytest.raises(ValueError, match="not in the model"):
        engine.update_weights({"model.no_such.weight": embed}, version=4)
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.update_weights({"lm_head.weight": head[:5]}, version=4)
    assert engine.weight_version == 3

    # Restoring the original tensors restores the original samples exactly.
    fresh = BuiltinEngine(model_dir).model.state_dict()
    engine.update_weights({k: fresh[k] for k in ("model.embed_tokens.weight", "lm_head.weight")}, version=5)
    _assert_same_samples(before, engine.generate(requests, sampling), atol=0.0)


def test_health_and_shutdown(model_dir):
    engine = BuiltinEngine(model_dir, max_batch_size=2)
    health = engine.health()
    assert health["ok"] and health["weight_version"] == 0 and health["max_batch_size"] == 2
    engine.shutdown()
    engine.shutdown()
    assert engine.health()["ok"] is False
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate([SampleRequest(prompt_ids=[3, 4], key=(0, 0, 0, 0))], SamplingParams())


def test_engine_rejects_bad_inputs(model_dir, engine):
    with pytest.raises(ConfigError, match="max_batch_size"):
        BuiltinEngine(model_dir, max_batch_size=0)
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([SampleRequest(prompt_ids=[1, 999], key=(0, 0, 0, 0))], SamplingParams())
    assert engine.generate([], SamplingParams()) == []


# ---------------------------------------------------------------------------------------------
# custom rollout
# ---------------------------------------------------------------------------------------------

TOOL_TEXT = "a tool returned : the answer is 42"
NOT_CALLABLE = 17


def two_turn_rollout(engine, prompts, sampling, keys, reward_fn):
    """A model turn, a tool reply (not trained on), a second model turn; scores its samples."""
    tool_ids = engine.tokenizer.encode(TOOL_TEXT)
    first_turn_sampling = dataclasses.replace(sampling, max_new_tokens=4)
    flat_keys = [key for prompt_keys in keys for key in prompt_keys]
    flat_prompts = [prompt for prompt, prompt_keys in zip(prompts, keys) for _ in prompt_keys]
    first = engine.generate(
        [SampleRequest(prompt_ids=p["prompt_ids"], key=turn_key(k, 0)) for p, k in zip(flat_prompts, flat_keys)],
        first_turn_sampling,
    )
    second = engine.generate(
        [
            SampleRequest(prompt_ids=p["prompt_ids"] + r.response_ids + tool_ids, key=turn_key(k, 1))
            for p, k, r in zip(flat_prompts, flat_keys, first)
        ],
        sampling,
    )
    samples = []
    for prompt, a, b in zip(flat_prompts, first, second):
        response = a.response_ids + tool_ids + b.response_ids
        sample = SampleResult(
            prompt_ids=prompt["prompt_ids"],
            response_ids=response,
            response_logprobs=a.response_logprobs + [0.0] * len(tool_ids) + b.response_logprobs,
            text=engine.tokenizer.decode(response, skip_special_tokens=True),
            finish_reason=b.finish_reason,
            loss_mask=[1] * len(a.response_ids) + [0] * len(tool_ids) + [1] * len(b.response_ids),
        )
        sample.reward = reward_fn(prompt, sample)
        samples.append(sample)
    grouped, start = [], 0
    for prompt_keys in keys:
        grouped.append(samples[start : start + len(prompt_keys)])
        start += len(prompt_keys)
    return grouped


def _reward_mentions_label(prompt: dict, sample: SampleResult) -> float:
    return float(prompt["label"] in sample.text)


def test_two_turn_custom_rollout(engine):
    rollout = load_custom_rollout(f"{__name__}:two_turn_rollout")
    assert rollout is two_turn_rollout
    prompts = [
        {"prompt_ids": engine.tokenizer.encode("what is two plus three ?"), "label": "42"},
        {"prompt_ids": engine.tokenizer.encode("hello"), "label": "five"},
    ]
    keys = [[(9, 2, p, s) for s in range(3)] for p in range(len(prompts))]
    sampling = SamplingParams(max_new_tokens=5)
    output = validate_rollout_output(rollout(engine, prompts, sampling, keys, _reward_mentions_label), prompts, keys)
    tool_ids = engine.tokenizer.encode(TOOL_TEXT)

    assert [len(group) for group in output] == [3, 3]
    for prompt, group in zip(prompts, output):
        for sample in group:
            mask = sample.effective_loss_mask()
            first_len = mask.index(0)
            assert mask[first_len : first_len + len(tool_ids)] == [0] * len(tool_ids)
            assert sample.response_ids[first_len : first_len + len(tool_ids)] == tool_ids
            second_start = first_len + len(tool_ids)
            context = sample.prompt_ids + sample.response_ids[:second_start]
            forced = engine.logprobs_of(context, sample.response_ids[second_start:])
            assert forced == pytest.approx(sample.response_logprobs[second_start:], abs=1e-5)
            assert sample.reward == (1.0 if prompt["label"] in sample.text else 0.0)
    assert output[0][0].reward == 1.0  # the tool text contains "42"

    again = rollout(engine, prompts, sampling, keys, _reward_mentions_label)
    assert [[s.response_ids for s in g] for g in again] == [[s.response_ids for s in g] for g in output]


def test_default_rollout_groups_samples_per_prompt(engine):
    prompts = [{"prompt_ids": engine.tokenizer.encode(t)} for t in ("hello", "what is", "compute 12")]
    keys = [[(1, 0, p, s) for s in range(n)] for p, n in enumerate((2, 1, 3))]
    output = validate_rollout_output(default_rollout(engine, prompts, SamplingParams(max_new_tokens=4), keys), prompts, keys)
    flat = engine.generate(
        [SampleRequest(prompt_ids=p["prompt_ids"], key=k) for p, ks in zip(prompts, keys) for k in ks],
        SamplingParams(max_new_tokens=4),
    )
    assert [len(g) for g in output] == [2, 1, 3]
    _assert_same_samples([s for g in output for s in g], flat, atol=0.0)


def test_turn_keys_are_distinct():
    key = (1, 2, 3, 4)
    assert turn_key(key, 0) == key
    assert len({turn_key((1, 2, 3, s), t) for s in range(8) for t in range(4)}) == 32


@pytest.mark.parametrize(
    "path, fragment",
    [
        ("no_colon_here", "package.module:function"),
        ("a:b:c", "package.module:function"),
        (":fn", "package.module:function"),
        ("no_such_module_for_grpoflow:fn", "cannot import"),
        (f"{__name__}:no_such_function", "no attribute"),
        (f"{__name__}:NOT_CALLABLE", "not a function"),
    ],
)
def test_bad_custom_rollout_path_is_one_line_config_error(path, fragment):
    with pytest.raises(ConfigError) as info:
        load_custom_rollout(path)
    message = str(info.value)
    assert message.startswith("rollout.custom_rollout") and fragment in message and "\n" not in message


def test_validate_rollout_output_names_contract_violations():
    prompts = [{"prompt_ids": [1, 2]}]
    keys = [[(0, 0, 0, 0), (0, 0, 0, 1)]]
    good = {"prompt_ids": [1, 2], "response_ids": [5, 6], "response_logprobs": [-1.0, -2.0], "loss_mask": [1, 0]}
    assert validate_rollout_output([[good, dict(good)]], prompts, keys)[0][1].loss_mask == [1, 0]
    cases = [
        ([[good]], "must get 2 samples"),
        ([], "one list per prompt"),
        ([[good, {**good, "loss_mask": [1]}]], "loss_mask of 1"),
        ([[good, {**good, "loss_mask": [1, 2]}]], "0/1"),
        ([[good, {**good, "response_logprobs": [-1.0]}]], "1 logprobs for 2"),
        ([[good, {**good, "prompt_ids": [1, 2, 5]}]], "prompt_ids different"),
        ([[good, {k: v for k, v in good.items() if k != "response_ids"}]], "lacks 'response_ids'"),
        ([[good, 3]], "expected a SampleResult"),
    ]
    for output, fragment in cases:
        with pytest.raises(ConfigError, match=fragment):
            validate_rollout_output(output, prompts, keys)


# ---------------------------------------------------------------------------------------------
# data-parallel rollout: several built-in engines behind one handle
# ---------------------------------------------------------------------------------------------

def test_requests_split_into_whole_groups_balanced_by_count(engine):
    from runtime.rollout.sharding import split_ranges
    reqs = _requests(engine, samples_per_prompt=3)  # 4 prompts x 3 samples
    assert split_ranges(reqs, 1) == [range(0, 12)]
    assert split_ranges(reqs, 2) == [range(0, 6), range(6, 12)]
    assert split_ranges(reqs, 4) == [range(0, 3), range(3, 6), range(6, 9), range(9, 12)]
    assert split_ranges(reqs[:3], 2) == [range(0, 3), range(3, 3)]  # one group: the other engine idles
    five = split_ranges(reqs, 5)
    assert [i for r in five for i in r] == list(range(12)) and all(len(r) % 3 == 0 for r in five)
    # the same prompt under another key prefix (another rollout) is another group
    mixed = _requests(engine, samples_per_prompt=2)[:2] + _requests(engine, samples_per_prompt=2, rollout_id=1)[:2]
    assert split_ranges(mixed, 2) == [range(0, 2), range(2, 4)]


def test_a_members_user_error_reaches_the_driver_as_its_one_line(ray_session):
    """An engine actor's UserError (say SGLang rejecting a request) comes out of the group as itself: `grpoflow run`
    prints its one line, not Ray's text of the actor's traceback."""
    import ray

    from runtime.placement.groups import RayGroup

    @ray.remote(num_cpus=0)
    class Refuses:
        def go(self):
            raise ConfigError("rollout.top_p=0 keeps no token: use a value in (0, 1]")

    group = RayGroup([Refuses.remote()])
    try:
        with pytest.raises(ConfigError) as err:
            group.call("go")
        assert type(err.value) is ConfigError and str(err.value) == "rollout.top_p=0 keeps no token: use a value in (0, 1]"
    finally:
        group.kill()


@pytest.fixture(scope="module")
def engine_pool(ray_session, model_dir):
    """Two built-in engines as Ray actors (cluster.rollout_gpus=2 on CPU) and one in-process engine of the
    same config, to compare with."""
    from runtime.config import GrpoConfig
    from runtime.placement.cluster import Cluster
    from runtime.rollout.factory import make_engine
    cfg = GrpoConfig.model_validate({
        "cluster": {"backend": "ray", "device": "cpu", "rollout_gpus": 2, "placement_timeout_s": 60},
        "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 3},
        "train": {"global_batch_size": 12, "micro_batch_size": 4}})
    cluster = Cluster(cfg).start()
    pool = cluster.engine(model_dir)
    try:
        yield pool, make_engine(cfg=cfg, model_dir=model_dir, device="cpu", dtype=cluster.dtype)
    finally:
        pool.kill()
        cluster.shutdown()


def _same_tokens(pool: list[SampleResult], one: list[SampleResult]) -> float:
    # log-probs within float noise, not bitwise: CPU GEMM blocking depends on the batch's rows (as above)
    return _assert_same_samples(pool, one, atol=1e-5)


def test_two_engines_make_the_samples_of_one(engine_pool):
    from runtime.rollout import GroupsDone
    pool, one = engine_pool
    assert pool.engines == 2 and len(pool.health()["engines"]) == 2
    reqs = _requests(one, samples_per_prompt=3, rollout_id=2)  # 4 groups: 2 per engine
    # groups complete at different decode chunks: the 2nd (engine 0) and the 4th (engine 1) first
    sp = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=64, stop_token_ids=[5, 6])
    whole = pool.generate(reqs, sp)
    _same_tokens(whole, one.generate(reqs, sp))
    # partial rollout's stop: the engines step together and stop once 2 groups of all 4 are complete
    until = GroupsDone(group_size=3, count=2)
    cut = pool.generate(reqs, sp, until)
    assert "".join(r.finish_reason[0] for r in cut) == "asasssasasss"
    _same_tokens(cut, one.generate(reqs, sp, until))
    # the unfinished samples continued (prefixes) through the pool end as the unbroken ones
    continued = [SampleRequest(prompt_ids=q.prompt_ids, key=q.key, prefix_ids=r.response_ids,
                               prefix_logprobs=r.response_logprobs) for q, r in zip(reqs, cut)]
    _same_tokens(pool.generate(continued, sp), whole)
    _same_tokens(pool.generate(reqs[:3], sp), whole[:3])  # one group: the second engine sits the call out
    r = whole[0]
    assert pool.logprobs_of(r.prompt_ids, r.response_ids, 0.9) == pytest.approx(r.response_logprobs, abs=1e-5)


def test_weights_reach_every_engine_directly_and_by_broadcast(engine_pool):
    import threading

    from runtime.placement import weight_sync
    from runtime.placement.ports import free_port
    pool, one = engine_pool
    reqs = _requests(one, samples_per_prompt=3)
    sp = SamplingParams(max_new_tokens=8)
    before = pool.generate(reqs, sp)
    g = torch.Generator().manual_seed(5)
    state = one.model.state_dict()
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    pool.update_weights(new, 1)
    one.update_weights(new, 1)
    after = pool.generate(reqs, sp)
    assert [r.response_ids for r in after] != [r.response_ids for r in before]
    _same_tokens(after, one.generate(reqs, sp))
    assert pool.health()["weight_version"] == 1

    # broadcast: rank 0 here, the engines as ranks 1 and 2 of one group
    back = {k: v - 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    port, box = free_port(), {}
    host = threading.Thread(target=lambda: box.update(g=weight_sync.init_group("127.0.0.1", port, 0, 3,
                                                                               group_name="t_dp_bcast")))
    host.start()
    assert pool.weight_sync_ranks() == 2
    pool.init_weight_sync("127.0.0.1", port, 1, 3, "t_dp_bcast")
    host.join()
    assert pool.weight_sync_ready()
    sender = threading.Thread(target=weight_sync.send, args=(box["g"], back, "cpu"))
    sender.start()
    pool.receive_weights(weight_sync.metadata_of(back), 2)
    sender.join()
    weight_sync.destroy_group(box["g"])
    one.update_weights(back, 2)
    assert pool.health()["weight_version"] == 2
    _same_tokens(pool.generate(reqs, sp), one.generate(reqs, sp))
