"""GRPO learns: from a random tiny model on the tiny config's synthetic task, mean reward rises by
≥ 0.2 absolute and by more than 3 standard errors; the same run with lr=0 stays within noise; and with
partial rollout on, samples are carried out of rollouts and trained later, and the reward reached over the
same rollouts is within noise of partial off. LoRA GRPO (train.lora) rises as much from a base first trained
briefly in full.

The task runs with up to 4 new tokens (the tiny config's 2 leave no room for ragged lengths), and the
engine admits requests and checks the stop every 2 decode steps: a sample ends wherever the policy samples
eos, so freed rows take new requests mid-rollout, and partial rollout stops with samples cut mid-way. One
reference run (partial off) serves every comparison."""
from __future__ import annotations

import statistics

import pytest

from runtime.config import load_config
from runtime.run import stages
from runtime.run.directory import RunDir
from tests.sessions import prepared_session

ROLLOUTS = 80
WINDOW = 10  # rollouts averaged at each end
LORA_ROLLOUTS, LORA_LR = 30, 3e-3  # LoRA: ~6x the full-parameter test's 5e-4 (1e-2 diverges on this model)
# ragged lengths and 1.5x groups in flight; TIS on in both modes so partial on differs only by partial rollout
TASK = ["rollout.max_new_tokens=4", "rollout.sync_every=2", "rollout.over_sampling_factor=1.5", "algorithm.use_tis=true"]


def _run(root, lr: float, rollouts: int, sets: tuple[str, ...] = ()) -> list[dict]:
    cfg = load_config("configs/tiny.yaml", TASK + [f"train.lr={lr}", f"train.num_rollout={rollouts}",
                                                   f"checkpoint.interval={rollouts}", "eval.interval=null",
                                                   "tracking.enabled=false", f"storage.root={root}", *sets])
    rd = RunDir(str(root), "learn")
    session = prepared_session(cfg, rd)
    try:
        return session.run_chunk(0, rollouts)["metrics"]
    finally:
        session.close()


def _briefly_trained_base(root, steps: int = 150, correct: float = 0.2) -> str:
    """The tiny model trained briefly in full (supervised, `steps` steps of 32 of the task's prompts, seconds) on a
    near miss of the task: the answer is the prompt's digit with probability `correct`, else the next digit. It
    learns to read the digit and answer confidently (its embeddings and norms grow out of their random init) but
    mostly off by one: reward ~0.2. Returns the HF model dir."""
    import random
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.inputs.datasets import read_prepared
    cfg = load_config("configs/tiny.yaml", [f"storage.root={root}", "tracking.enabled=false"])
    rd = RunDir(str(root), "base")
    fetched = stages.fetch(cfg, rd)
    stages.prepare(cfg, rd, fetched)
    rows = read_prepared(rd.train_data)
    tok = AutoTokenizer.from_pretrained(rd.hf_model)
    model = AutoModelForCausalLM.from_pretrained(rd.hf_model, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng, eos = random.Random(0), tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    for _ in range(steps):
        seqs, masks = [], []
        for r in (rows[rng.randrange(len(rows))] for _ in range(32)):
            p = tok(r["prompt"], add_special_tokens=False)["input_ids"]
            digit = r["label"] if rng.random() < correct else str((int(r["label"]) + 1) % 10)
            a = tok(digit, add_special_tokens=False)["input_ids"] + [eos]
            seqs.append(p + a)
            masks.append([0] * len(p) + [1] * len(a))
        n = max(map(len, seqs))
        ids = torch.tensor([x + [0] * (n - len(x)) for x in seqs])
        mask = torch.tensor([x + [0] * (n - len(x)) for x in masks])[:, 1:]
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = root / "base-hf"
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copyfile(f"{rd.hf_model}/{f}", out / f)
    return str(out)


def _rewards(metrics: list[dict]) -> list[float]:
    return [m["reward_mean"] for m in metrics]


def _gain(rewards: list[float]) -> tuple[float, float]:
    first, last = rewards[:WINDOW], rewards[-WINDOW:]
    gain = statistics.fmean(last) - statistics.fmean(first)
    se = (statistics.variance(first) / len(first) + statistics.variance(last) / len(last)) ** 0.5
    return gain, se


@pytest.fixture(scope="module")
def learned(tmp_path_factory) -> list[float]:
    return _rewards(_run(tmp_path_factory.mktemp("learn"), 5e-4, ROLLOUTS))


def test_grpo_raises_reward_and_lr0_does_not(learned, tmp_path):
    gain, se = _gain(learned)
    assert gain >= 0.2 and gain > 3 * se, (gain, se, learned)

    frozen = _rewards(_run(tmp_path, 0.0, 2 * WINDOW))
    gain0, se0 = _gain(frozen)
    assert abs(gain0) < max(3 * se0, 0.05), (gain0, se0, frozen)


def test_partial_rollout_learns_as_well_as_partial_off(learned, tmp_path):
    metrics = _run(tmp_path, 5e-4, ROLLOUTS, ("rollout.partial=true",))
    # partial rollout really happened: unfinished samples left rollouts, and later ones continued and trained them
    assert sum(m["partial_buffered_samples"] > 0 for m in metrics) >= 10, [m["partial_buffered_samples"] for m in metrics]
    assert sum(m["partial_samples_continued"] for m in metrics) >= 20, [m["partial_samples_continued"] for m in metrics]
    assert all(m["partial_prompts_trained"] == 8 * (i + 1) for i, m in enumerate(metrics))  # golden rule

    partial = _rewards(metrics)
    gain, se = _gain(partial)
    assert gain >= 0.15 and gain > 3 * se, (gain, se, partial)
    # within noise of partial off over the same rollouts: the last windows differ by less than 3 standard
    # errors of their difference (and at least 0.1 of reward is allowed)
    off, on = learned[-WINDOW:], partial[-WINDOW:]
    se_diff = (statistics.variance(off) / WINDOW + statistics.variance(on) / WINDOW) ** 0.5
    assert statistics.fmean(off) - statistics.fmean(on) < max(3 * se_diff, 0.1), (off, on, se_diff)


def test_lora_grpo_learns_from_a_briefly_trained_base(tmp_path):
    """LoRA GRPO (rank 16, the base frozen, the engine decoding with the trainer's base) raises the reward as
    much, and as significantly, as the full-parameter test asks, from a base first trained briefly in full
    (`_briefly_trained_base`). From the random tiny model it does not (measured +0.01 in 80 rollouts): its
    embeddings and norms are random and stay frozen under LoRA, and there it learns like full-parameter training
    of the linears alone (both +0.10 in 40 rollouts where training everything gains +0.20). From the near-miss
    base (reward ~0.2) measured: 0.2 -> 0.9 in 40 rollouts."""
    base = _briefly_trained_base(tmp_path / "sft")
    metrics = _run(tmp_path / "lora", LORA_LR, LORA_ROLLOUTS, (f"model.source={base}", "train.lora.enabled=true",
                                                             "train.lora.rank=16", "train.lora.alpha=32"))
    assert all(m["train_rollout_logp_absdiff"] < 1e-4 for m in metrics)  # the engine samples the trainer's policy
    rewards = _rewards(metrics)
    gain, se = _gain(rewards)
    assert gain >= 0.2 and gain > 3 * se, (gain, se, rewards)
