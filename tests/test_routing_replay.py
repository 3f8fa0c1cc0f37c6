"""Rollout routing replay (R3, ``rollout.routing_replay``) on a tiny Qwen3-MoE on the CPU: the engine records each
token's experts, the trainer routes by them. The model's routers are built with a near-tie (two experts' router rows
a few ulps apart), so where those two straddle the top-k the engine and the trainer pick by rounding: without replay
they route some tokens differently and their log-probs part; with it every token goes where the engine sent it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # builds trainers and engines

TIED = (1, 2)  # the experts whose router rows are a few ulps apart


@pytest.fixture(scope="module")
def near_tie_moe(tmp_path_factory) -> tuple[Path, Path]:
    """(HF dir, torch_dist dir) of a 2-layer, 4-expert top-2 Qwen3-MoE whose routers nearly tie experts 1 and 2."""
    from safetensors.torch import load_file, save_file

    from runtime.mcore.convert import hf_to_torch_dist
    from runtime.models.tiny import build_tiny_qwen3

    work = tmp_path_factory.mktemp("r3")
    hf_dir = Path(build_tiny_qwen3(work / "hf", seed=3, hidden_size=64, head_dim=16, num_experts=4,
                                   experts_per_token=2, expert_ffn_size=32, ffn_hidden_size=64)["path"])
    weights = load_file(str(hf_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):
            w.mul_(20.0)  # sharp routing: a flipped expert moves the output
            a, b = TIED
            ulps = torch.randint(-2, 3, w[a].shape, generator=g)
            w[b] = w[a]
            for _ in range(2):  # each element 0..2 ulps away from expert a's
                w[b] = torch.where(ulps > 0, torch.nextafter(w[b], torch.full_like(w[b], float("inf"))),
                                   torch.where(ulps < 0, torch.nextafter(w[b], torch.full_like(w[b], -float("inf"))),
                                               w[b]))
                ulps = ulps - ulps.sign()
    save_file(weights, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    # the parity check would fail where the tie flips a token: that is the point here
    td = work / "torch_dist"
    hf_to_torch_dist(hf_dir, td, tolerance=1e9)
    return hf_dir, td


def _trainer(hf_dir, td, **train):
    from runtime.config import GrpoConfig
    from runtime.trainer.megatron_trainer import MegatronTrainer
    cfg = GrpoConfig()
    t = cfg.train.model_copy(update=dict(micro_batch_size=4, global_batch_size=8, **train))
    return MegatronTrainer(hf_dir=str(hf_dir), init_checkpoint=str(td), train=t, algorithm=cfg.algorithm,
                           temperature=1.0)


def _trainer_routes(trainer, batch) -> list[torch.Tensor]:
    """The experts the trainer's routers sent each sample's tokens to in `compute_logprobs` ([tokens - 1, layers, k],
    each token's set sorted), read from the routers' routing maps."""
    from megatron.core.transformer.moe.router import TopKRouter
    maps: list[list[torch.Tensor]] = []
    routers = [m for m in trainer.model.modules() if isinstance(m, TopKRouter)]
    hooks = [r.register_forward_hook(lambda mod, inp, out: maps[-1].append(out[1].detach().clone()))
             for r in routers]
    per_sample: list[torch.Tensor] = [None] * len(batch)
    try:
        for idx in trainer._micro_batches(list(range(len(batch))), batch):
            maps.append([])
            mb = trainer._pack(batch, idx)
            from runtime.trainer import routing_replay
            with routing_replay.replaying(trainer.model, mb.routes), torch.no_grad():
                trainer.model.eval()
                trainer._token_logprobs(trainer.model, mb)
            width, rows = mb.input_ids.shape[1], mb.input_ids.shape[0]
            k = trainer.hf_config.num_experts_per_tok
            # routing map [width * rows, E] per layer -> each token's experts, sorted
            chosen = torch.stack([m.nonzero()[:, 1].view(-1, k) for m in maps[-1]], 1).view(width, rows, -1, k)
            for i, (row, start) in zip(mb.seq_ids, mb.starts):
                per_sample[i] = chosen[start:start + len(batch.tokens[i]) - 1, row]
    finally:
        for h in hooks:
            h.remove()
    return per_sample


def test_the_trainer_routes_every_token_where_the_engine_did(near_tie_moe):
    from runtime.rollout.base import SampleRequest, SamplingParams
    from runtime.rollout.builtin import BuiltinEngine
    from runtime.trainer.batch import TrainBatch

    hf_dir, td = near_tie_moe
    engine = BuiltinEngine(str(hf_dir), routing_replay=True, max_batch_size=16)
    assert engine.health()["records_routes"] is True
    try:
        prompts = [[5 + (7 * p + j) % 40 for j in range(6 + p)] for p in range(4)]
        results = engine.generate([SampleRequest(prompt_ids=q, key=(0, 0, p, s)) for p, q in enumerate(prompts)
                                   for s in range(4)], SamplingParams(max_new_tokens=12))
    finally:
        engine.shutdown()
    for r in results:  # every token the engine ran: the prompt and the response but its last
        assert r.routed_experts.shape == (len(r.prompt_ids) + len(r.response_ids) - 1, 2, 2)
        assert r.routed_experts.dtype == torch.uint8
    kw = dict(tokens=[r.prompt_ids + r.response_ids for r in results], prompt_lens=[len(r.prompt_ids) for r in results],
              advantages=[(-1.0) ** i for i in range(len(results))],
              loss_masks=[r.effective_loss_mask() for r in results],
              rollout_logprobs=[r.response_logprobs for r in results])
    replayed, own = TrainBatch(**kw, routes=[r.routed_experts for r in results]), TrainBatch(**kw)
    engine_sets = [r.routed_experts.long().sort(-1).values for r in results]
    # packed micro-batches (every sample back to back in one row) lay the routes out as padded ones do
    packed = _trainer(hf_dir, td, max_tokens_per_micro_batch=128)
    assert all(torch.equal(a, b) for a, b in zip(_trainer_routes(packed, replayed), engine_sets))
    trainer = _trainer(hf_dir, td)
    with_replay, without = _trainer_routes(trainer, replayed), _trainer_routes(trainer, own)
    assert all(torch.equal(a, b) for a, b in zip(with_replay, engine_sets))
    differ = sum(int((a != b).any(-1).sum()) for a, b in zip(without, engine_sets))
    assert differ > 0, "the near-tie made no token route differently: the test shows nothing"

    def gap(batch, by=trainer):
        got = by.compute_logprobs(batch)
        return max(abs(a - b) for g, r in zip(got, results) for a, b in zip(g, r.response_logprobs))
    gap_replayed, gap_own = gap(replayed), gap(own)
    assert gap(replayed, packed) <= 1e-4
    print(f"tokens routed differently without replay: {differ}; log-prob gap {gap_own:.2e} -> {gap_replayed:.2e}")
    assert gap_replayed <= 1e-4 < gap_own
    # the update replays too (its first micro-step's gap is the metric's), and the router still trains (the routing
    # weights at the replayed experts are its own softmax; its load-balancing loss)
    router = "model.layers.0.mlp.gate.weight"
    before = trainer.hf_weights()[router].clone()  # on the CPU a view of the parameter
    assert trainer.train(replayed)["train_rollout_logp_absdiff"] <= 1e-5
    assert not torch.equal(trainer.hf_weights()[router], before)
    # whole layers recomputed in the backward route by the same routes (else the near-tie tokens' recomputed
    # activations, hence the update, would differ)
    recomputed = _trainer(hf_dir, td, recompute="full")
    recomputed.train(replayed)
    want, got = trainer.hf_weights(), recomputed.hf_weights()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_preempted_and_continued_samples_record_the_routes_of_an_unbroken_call(tmp_path):
    """Routes are per position, the first recorded standing: a call whose pool is too small for its rows (rows
    preempted, their prompt and tokens prefilled again) and samples continued from half their tokens with the
    routes recorded for them (partial rollout) come back with the routes of an unpressed, unbroken call. (On a
    router without near-ties: at a near-tie the route follows the decode batch's rounding, which the pressed call's
    smaller batches change; replay trains on whichever the engine ran.)"""
    from runtime.models.tiny import build_tiny_qwen3
    from runtime.rollout.base import SampleRequest, SamplingParams
    from runtime.rollout.builtin import BuiltinEngine
    from runtime.rollout.kv_pages import kv_bytes_per_token

    hf_dir = build_tiny_qwen3(tmp_path / "moe", seed=3, hidden_size=64, head_dim=16, num_experts=8,
                              experts_per_token=2, expert_ffn_size=32, ffn_hidden_size=64)["path"]
    reqs = [SampleRequest(prompt_ids=[5 + (3 * p + j) % 40 for j in range(4 + 2 * p)], key=(1, 0, p, s))
            for p in range(3) for s in range(3)]
    sp = SamplingParams(max_new_tokens=20)
    roomy = BuiltinEngine(str(hf_dir), routing_replay=True, max_batch_size=9)
    want = roomy.generate(reqs, sp)
    per_page = 4 * kv_bytes_per_token(roomy.model.config, "float32")
    roomy.shutdown()
    pressed = BuiltinEngine(str(hf_dir), routing_replay=True, max_batch_size=6, page_size=4, sync_every=4,
                            kv_cache_gb=12 * per_page / 2**30)
    try:
        got = pressed.generate(reqs, sp)
        assert pressed.decoder.stats["preemptions"] > 0
        cut = [len(r.response_ids) // 2 for r in want]
        continued = pressed.generate([
            SampleRequest(prompt_ids=q.prompt_ids, key=q.key, prefix_ids=r.response_ids[:m],
                          prefix_logprobs=r.response_logprobs[:m],
                          prefix_routes=r.routed_experts[:len(q.prompt_ids) + m - 1] if m else None)
            for q, r, m in zip(reqs, want, cut)], sp)
    finally:
        pressed.shutdown()
    for ours in (got, continued):
        assert [r.response_ids for r in ours] == [r.response_ids for r in want]
        assert all(torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(ours, want))


def test_partial_rollout_carries_the_routes_and_a_resumed_run_replays_them(tmp_path_factory, tmp_path):
    """configs/tiny-moe.yaml with R3 and partial rollout through a real session: the unfinished samples' routes
    are in the checkpointed buffer (prompt and tokens so far), and a session resumed from the checkpoint (a new
    engine and trainer) ends bitwise as the unbroken one."""
    import shutil

    from runtime.config import load_config
    from runtime.grpo.partial import decode_routes
    from runtime.grpo.session import TrainSession
    from runtime.run import stages
    from runtime.run.directory import RunDir
    from tests.test_partial_rollout import PARTIAL, _untimed
    from tests.test_resume import assert_same_checkpoint, checkpoint_tensors

    def session(root):
        cfg = load_config("configs/tiny-moe.yaml", PARTIAL + ["rollout.routing_replay=true", f"storage.root={root}"])
        rd = RunDir(str(root), "r3")
        if not (root / "runs" / "r3" / "model").exists():
            fetched = stages.fetch(cfg, rd)
            stages.convert(cfg, rd, fetched)
            stages.prepare(cfg, rd, fetched)
        return TrainSession(cfg, rd)

    root = tmp_path_factory.mktemp("r3-partial")
    s = session(root)
    try:
        first = s.run_chunk(0, 2)["metrics"]
        s.wait_durable(2)
        buffer = s.state["partial"]["buffer"]
        copy = tmp_path_factory.mktemp("r3-partial-at-2") / "root"
        shutil.copytree(root, copy)
        second = s.run_chunk(2, 4)["metrics"]
    finally:
        s.close()
    carried = [(g["prompt"]["prompt_ids"], c) for g in buffer for c in g["samples"] if c["ids"]]
    assert carried and any(c["finish"] == "abort" for _, c in carried)
    for prompt_ids, c in carried:  # the prompt's routes and those of every token so far but the last
        assert tuple(decode_routes(c["routes"]).shape) == (len(prompt_ids) + len(c["ids"]) - 1, 2, 2)
    assert any(m["partial_tokens_reused"] > 0 for m in second)
    assert first[0]["train_rollout_logp_absdiff"] < 1e-5  # nothing carried yet: one set of weights, same routes
    resumed = session(copy)
    try:
        again = resumed.run_chunk(2, 4)["metrics"]
    finally:
        resumed.close()
    assert _untimed(again) == _untimed(second)
    assert_same_checkpoint(checkpoint_tensors(RunDir(str(copy), "r3").checkpoint(4), tmp_path),
                           checkpoint_tensors(RunDir(str(root), "r3").checkpoint(4), tmp_path))
