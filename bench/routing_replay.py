"""Rollout routing replay (R3, issue 60 item 4) measured: the built-in engine samples with its routes recorded, and
megatron's trainer model, on the same weights, scores the samples routing itself and replaying the engine's routes.

Per mode (own routing, replay): the fraction of (token, MoE layer) pairs and of tokens (any layer) whose expert set
differs from the engine's, the engine-vs-trainer log-prob gap over the response tokens (mean, p99, max), and the
spread of the first micro-step's PPO ratio against the rollout (exp(trainer - engine log-prob): what TIS weighs;
with one step per rollout the ratio to the old policy is 1 by construction): std, min, max.

    python3 bench/routing_replay.py --layers 8 --out $OUT/routing_replay.json  # one H200, full width, 8 layers (~3 min)
    python3 bench/routing_replay.py --out $OUT/routing_replay.json             # the whole 48-layer shape (2 x 61 GB)
    python3 bench/routing_replay.py --cpu                                      # smoke: a 2-layer, 8-expert model

On the GPU machine megatron-core is carried: `python3 bench/gpu_carry.py install && export
PYTHONPATH=/tmp/site:$PYTHONPATH` first (bench/README.md). Random init (normal 0.02, norms 1), bf16, the engine's
model built on the GPU as moe_engine.py; the trainer's model is megatron's local spec loaded from it (no disk).
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

import rollout_bench as rb
from moe_engine import QWEN3_30B_A3B, TINY, build


def trainer_model(hf_model, device: str, dtype):
    """megatron's GPTModel of the HF model's config with its weights, replay slots on (runtime/trainer/routing_replay.py)."""
    from runtime.mcore.convert import _load_mapped_weights
    from runtime.mcore.env import build_gpt_model
    from runtime.models import get_adapter
    from runtime.trainer import routing_replay
    cfg = hf_model.config
    model = build_gpt_model(cfg, dtype=dtype, device=device, init_weights=False, **routing_replay.config_overrides())
    routing_replay.own_routers(model)
    mapped = get_adapter(cfg).from_hf({k: v.detach() for k, v in hf_model.state_dict().items()}, cfg)
    _load_mapped_weights(model, {k: v.to(dtype) for k, v in mapped.items()}, Path("engine"))
    return model.eval()


@torch.no_grad()
def score(model, batch, micro: int, replay: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sample: the trainer's log-probs of the response tokens and its experts [tokens - 1, layers, k] (sorted)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from runtime.mcore.env import causal_attention_mask
    from runtime.trainer import routing_replay
    from runtime.trainer.batch import pack
    dev = next(model.parameters()).device
    maps: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: maps.append(out[1])) for m in model.modules()
             if isinstance(m, TopKRouter)]
    logps, experts = [None] * len(batch), [None] * len(batch)
    k = model.config.moe_router_topk
    try:
        for start in range(0, len(batch), micro):
            idx = list(range(start, min(start + micro, len(batch))))
            mb = pack(batch, idx, dev)
            maps.clear()
            b, s = mb.input_ids.shape
            with routing_replay.replaying(model, mb.routes if replay else None):
                logits = model(mb.input_ids, mb.position_ids, causal_attention_mask(b, s, dev))
            lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb.targets[..., None]).squeeze(-1)
            chosen = torch.stack([m.nonzero()[:, 1].view(-1, k) for m in maps], 1).view(s, b, -1, k)
            for row, i in enumerate(idx):
                p, n = batch.prompt_lens[i], len(batch.tokens[i])
                logps[i] = lp[row, p - 1:n - 1].cpu()
                experts[i] = chosen[:n - 1, row].cpu()
    finally:
        for h in hooks:
            h.remove()
    return logps, experts


def compare(batch, engine_lp, engine_sets, logps, experts) -> dict:
    pair_diff = torch.cat([(a != b).any(-1).reshape(-1) for a, b in zip(experts, engine_sets)]).float()
    tok_diff = torch.cat([(a != b).any(-1).any(-1) for a, b in zip(experts, engine_sets)]).float()
    gap = torch.cat([(a - torch.tensor(e)) for a, e in zip(logps, engine_lp)])
    ratio = gap.exp()
    return {"expert_set_differs_token_layer": round(pair_diff.mean().item(), 6),
            "expert_set_differs_token_any_layer": round(tok_diff.mean().item(), 6),
            "logp_gap_mean": round(gap.abs().mean().item(), 6), "logp_gap_p99": round(gap.abs().quantile(0.99).item(), 5),
            "logp_gap_max": round(gap.abs().max().item(), 5), "ratio_std": round(ratio.std().item(), 6),
            "ratio_min": round(ratio.min().item(), 5), "ratio_max": round(ratio.max().item(), 5),
            "response_tokens": gap.numel()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=None, help="depth (default: the model's 48)")
    ap.add_argument("--kv-gib", type=float, default=16.0)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--new", type=int, default=None, help="response tokens per sample (forced length)")
    args = ap.parse_args()
    from runtime.rollout.base import SamplingParams
    from runtime.rollout.keyed_sampling import sample_key_hash
    from runtime.rollout.paged_decode import PagedDecoder
    from runtime.trainer.batch import TrainBatch

    cuda = not args.cpu
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    cfg_dict = dict(QWEN3_30B_A3B if cuda else TINY)
    if args.layers:
        cfg_dict["num_hidden_layers"] = args.layers
    prompts, samples = (args.prompts or (16 if cuda else 2)), (8 if cuda else 2)
    prompt_len, new = (256, args.new or 512) if cuda else (8, args.new or 12)
    res: dict = {"benchmark": "routing_replay", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                 "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                 "layers": cfg_dict["num_hidden_layers"], "experts": cfg_dict["num_experts"],
                 "top_k": cfg_dict["num_experts_per_tok"], "samples": prompts * samples, "prompt_len": prompt_len,
                 "new_tokens": new}
    t0 = time.time()
    hf = build(cfg_dict, device, dtype)
    dec = PagedDecoder(hf, max_rows=prompts * samples, kv_cache_gb=args.kv_gib if cuda else 0.01, record_routes=True)
    S = dict(rb.SHAPES["gpu" if cuda else "cpu"], vocab=cfg_dict["vocab_size"])
    reqs = rb.requests(S, prompts, samples, prompt_len, rollout=1, seed=1)
    kh = sample_key_hash(torch.tensor([r.key for r in reqs], dtype=torch.long, device=dec.device))
    t1 = time.time()
    ids, lps, _ = dec.generate([r.prompt_ids for r in reqs], kh, SamplingParams(temperature=1.0, max_new_tokens=new),
                               set(), stop_at=[new] * len(reqs))
    res["generate_s"] = round(time.time() - t1, 1)  # the engine's compile and graph capture included
    res["engine"] = {"compiled": dec.compiled, "cuda_graphs": dec.use_graphs,
                     "fallbacks": dict(dec.stats).get("fallbacks", [])}
    routes = dec.last_routes
    res["routes_bytes_per_token"] = routes[0][0].numel() * routes[0].element_size()
    dec.release()
    trainer = trainer_model(hf, device, dtype)
    del dec, hf
    if cuda:
        torch.cuda.empty_cache()
    batch = TrainBatch(tokens=[r.prompt_ids + t for r, t in zip(reqs, ids)], prompt_lens=[len(r.prompt_ids) for r in reqs],
                       advantages=[0.0] * len(reqs), loss_masks=[[1] * len(t) for t in ids], rollout_logprobs=lps,
                       routes=routes)
    engine_sets = [r.long().sort(-1).values for r in routes]
    for mode, replay in (("own_routing", False), ("replay", True)):
        logps, experts = score(trainer, batch, 8 if cuda else 2, replay)
        res[mode] = compare(batch, lps, engine_sets, logps, experts)
    res["total_s"] = round(time.time() - t0, 1)
    print(f"{'':36}{'own routing':>14}{'replay':>14}")
    if cuda:
        res["peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    for key in res["replay"]:  # one row a measure, a column a mode
        print(f"{key:36}{res['own_routing'][key]:>14}{res['replay'][key]:>14}")
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
