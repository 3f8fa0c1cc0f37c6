"""Bench-only: fingerprints of every trainer's parameters and gradients at each optimizer step, so two runs that
should be bitwise equal can be compared step by step, and a difference placed: in the loaded state, in the
gradients a rank computed, or only after the data-parallel reduction (issue 37's runs under Ray).

On while GRPOFLOW_BENCH_GRAD_TRACE names a folder (bench/keyed_lengths/sitecustomize.py applies :func:`patch` when
``runtime.trainer.megatron_trainer`` is first imported, in every process of the run, Ray's actors included). Each
trainer rank appends a line per stage to ``<folder>/rank<dp>-<tp>-<pid>.jsonl``: ``params`` (as the step's gradients
are complete: resident, not yet stepped), ``grads-local`` (every micro-batch's backward done, before
``finalize_model_grads``) and ``grads-reduced`` (after it), keyed by the optimizer steps done so far. A fingerprint
is two exact integer sums over the tensor's bits (summed on its device in int64: the same whatever the order), so
equal bits give equal fingerprints and one flipped bit changes them. Before them, ``batch``: what the rank was handed
to train on, each sample's tokens and the engine's log-probs of them apart (``tokens/7``, ``rollout_logprobs/7``),
with its advantages: a step whose batch differs says so there (other tokens, or the same tokens with other
log-probs: the engine), where the mean length and reward of a rollout cannot (the bench's keyed lengths and
length reward make them equal whatever the tokens). And ``engine``, one line per generate call of the built-in
engine (:func:`patch_engine`): its weights' fingerprints and state as the call began, its schedule, and each
sample's tokens and log-probs (also their first 1, 16 and 256: where in a sample two runs part).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path

ENV = "GRPOFLOW_BENCH_GRAD_TRACE"
STAGES = ("batch", "params", "grads-local", "grads-reduced")
_CHUNK = 1 << 24
_INT_OF = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


def fingerprint(t) -> str:
    """Two integer sums over ``t``'s bits: plain, and weighted by position modulo 251."""
    import torch
    flat = t.detach().contiguous().view(-1)
    bits = flat.view(getattr(torch, _INT_OF[flat.element_size()]))
    plain = weighted = 0
    for start in range(0, bits.numel(), _CHUNK):
        v = bits[start:start + _CHUNK].to(torch.int64)
        w = (torch.arange(start, start + v.numel(), device=v.device, dtype=torch.int64) % 251) + 1
        plain += int(v.sum())
        weighted += int((v * w).sum())
    return f"{plain}:{weighted}"


def _float_digest(values: list[float]) -> str:
    """Floats by their bits, as a sha256 prefix."""
    return hashlib.sha256(struct.pack(f"<{len(values)}d", *values)).hexdigest()[:16]


def _tokens_digest(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def batch_digests(batch) -> dict[str, str]:
    """Each sample's tokens and rollout log-probs (their float bits), and the advantages, as sha256 prefixes."""
    out = {"advantages": _float_digest(batch.advantages)}
    for i, (tokens, logprobs) in enumerate(zip(batch.tokens, batch.rollout_logprobs)):
        out[f"tokens/{i}"] = _tokens_digest(tokens)
        out[f"rollout_logprobs/{i}"] = _float_digest(logprobs)
    return out


def _record(trainer, stage: str, folder: Path, batch=None) -> None:
    if stage == "batch":
        digests = batch_digests(batch)
    elif stage == "params":
        digests = {name: fingerprint(p) for name, p in trainer.model.named_parameters()}
    else:
        digests = {}
        for name, p in trainer.model.named_parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                digests[name] = fingerprint(g)
    mpu = getattr(trainer, "mpu", None)
    tp = mpu.get_tensor_model_parallel_rank() if mpu is not None else 0
    line = {"stage": stage, "step": trainer.steps_done, "dp": trainer.dp_rank, "tp": tp, "digests": digests}
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"rank{trainer.dp_rank}-{tp}-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


# Module-level, not closures: Ray pickles the trainer's class with its methods, and a module function pickles as a
# name (every process on this PYTHONPATH imports this module and patches its own trainer class).
_PLAIN: dict = {}
_CURRENT = threading.local()


def _train(self, batch):
    _CURRENT.trainer = self
    _record(self, "batch", Path(os.environ[ENV]), batch)
    try:
        return _PLAIN["train"](self, batch)
    finally:
        _CURRENT.trainer = None


def _finalize_model_grads(*args, **kwargs):
    trainer = getattr(_CURRENT, "trainer", None)
    folder = Path(os.environ[ENV])
    if trainer is not None:  # the parameters here: resident (offload reloaded them), not yet stepped
        _record(trainer, "params", folder)
        _record(trainer, "grads-local", folder)
    out = _PLAIN["finalize"](*args, **kwargs)
    if trainer is not None:
        _record(trainer, "grads-reduced", folder)
    return out


def patch(module) -> None:
    """``module`` is runtime.trainer.megatron_trainer: its trainer's ``train`` and the ``finalize_model_grads`` it
    imports at each call, wrapped to record."""
    import megatron.core.distributed as mcd

    if "train" not in _PLAIN:
        _PLAIN["train"], _PLAIN["finalize"] = module.MegatronTrainer.train, mcd.finalize_model_grads
    module.MegatronTrainer.train = _train
    mcd.finalize_model_grads = _finalize_model_grads


# -- the engine's side: what each generate call started from, how it was scheduled, what it drew -------------
ENGINE_STATE = ("prefix_cols", "own_cols", "rows", "_chunk_split_tokens", "compiled", "use_graphs", "use_triton",
                "cascade", "_chunk_prompt_split_tokens")
ENGINE_SCHEDULE = ("prefills", "prefill_tokens", "prefill_pack_max", "decode_steps", "row_steps", "chunks",
                   "max_active", "compactions", "preemptions", "reprefill_tokens", "peak_pages_used", "aborted",
                   "new_tokens")


def _engine_call_name(requests, sampling) -> str:
    """The same call in two runs: its rollout and first sample (the samples' keys: an engine's share of a
    rollout), size and token cap."""
    _, rollout, prompt, sample = requests[0].key
    return f"rollout{rollout}-from{prompt}.{sample}-n{len(requests)}-max{sampling.max_new_tokens}"


def _engine_call_start(engine) -> dict:
    dec = engine.decoder
    out = {f"weights/{name}": fingerprint(t) for name, t in engine.model.state_dict().items()}
    out.update({f"state/{k}": str(getattr(dec, k, None)) for k in ENGINE_STATE})
    out["state/graphs"] = str(len(dec.graphs))
    out["state/pool_used"] = str(None if dec.pool is None else dec.pool.used)
    out["state/table"] = str(None if getattr(dec, "table", None) is None else tuple(dec.table.shape))
    return out


def _engine_call_end(engine, results) -> dict:
    stats = engine.decoder.stats
    out = {f"schedule/{k}": str(stats.get(k)) for k in ENGINE_SCHEDULE}
    for i, r in enumerate(results):
        out[f"tokens/{i}"] = _tokens_digest(r.response_ids)
        out[f"logprobs/{i}"] = _float_digest(r.response_logprobs)
        for k in LOGPROB_PREFIXES:  # where in a sample two runs part: its first k log-probs
            out[f"logprobs_first/{k}/{i}"] = _float_digest(r.response_logprobs[:k])
    return out


LOGPROB_PREFIXES = (1, 16, 256)


def _decoder_steps(self, requests, sampling):
    """The engine's generate, recorded: stage ``engine``, the call's name as its step."""
    name, start = _engine_call_name(requests, sampling), _engine_call_start(self)
    results = yield from _PLAIN["decoder_steps"](self, requests, sampling)
    line = {"stage": "engine", "step": name, "dp": 0, "tp": 0,
            "digests": {**start, **_engine_call_end(self, results)}}
    folder = Path(os.environ[ENV])
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"engine-{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    return results


def patch_engine(module) -> None:
    """``module`` is runtime.rollout.builtin: its engine's paged generate wrapped to record (stage ``engine``)."""
    if "decoder_steps" not in _PLAIN:
        _PLAIN["decoder_steps"] = module.BuiltinEngine._decoder_steps
    module.BuiltinEngine._decoder_steps = _decoder_steps


def engine_difference(run: dict, reference: dict) -> dict:
    """Each generate call both runs made (by name; the last process's where a rebuilt engine made it again):
    what differs between them, grouped (the engine's weights as the call began, its state then, the call's
    schedule, the tokens and log-probs it drew)."""
    def calls(trace: dict) -> dict:
        return {k[1]: v for k, v in trace.items() if k[0] == "engine"}
    mine, theirs = calls(run), calls(reference)
    out = {}
    for name in sorted(set(mine) & set(theirs)):
        a, b = mine[name], theirs[name]
        differ = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        groups: dict = {}
        for k in differ:
            groups.setdefault(k.split("/")[0], []).append(k.split("/", 1)[1])
        first = groups.pop("logprobs_first", [])
        out[name] = {g: (v if g in ("state", "schedule") else len(v)) for g, v in groups.items()} or "same"
        for g in ("state", "schedule"):
            if g in groups:
                out[name][g] = {k: (a.get(f"{g}/{k}"), b.get(f"{g}/{k}")) for k in groups[g]}
        if "logprobs" in groups:
            # which samples, and how many of them already apart in their first 1, 16, 256 log-probs
            out[name]["samples_apart"] = sorted(int(i) for i in groups["logprobs"])
            out[name]["apart_within_first"] = {k: sum(1 for f in first if f.split("/")[0] == str(k))
                                               for k in LOGPROB_PREFIXES}
    return out


def read(folder: Path) -> dict:
    """(stage, step, dp, tp) -> {parameter: fingerprint}; a step recorded twice (by a killed process and its
    rebuilt successor) keeps the last process's line."""
    out: dict = {}
    for f in sorted(Path(folder).glob("*.jsonl"), key=lambda p: p.stat().st_mtime):
        for raw in f.read_text().splitlines():
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:  # the last line of a killed process
                continue
            out[(line["stage"], line["step"], line["dp"], line["tp"])] = line["digests"]
    return out


def first_difference(run: dict, reference: dict) -> dict:
    """The first (step, stage) where ``run`` and ``reference`` differ, with the parameters that differ there, in the
    order a step makes them (the state at entry, a rank's own gradients, the reduced ones); None if none does."""
    keys = sorted((k for k in set(run) & set(reference) if k[0] in STAGES),
                  key=lambda k: (k[1], STAGES.index(k[0]), k[2], k[3]))

    def differ(k) -> list[str]:
        return sorted(n for n in set(run[k]) | set(reference[k]) if run[k].get(n) != reference[k].get(n))
    for k in keys:
        if names := differ(k):
            # the whole of that step, every stage and rank: one rank or all, reduced or not
            at_step = {f"{s}/dp{d}/tp{t}": len(differ((s, st, d, t))) for s, st, d, t in keys if st == k[1]}
            return {"compared": len(keys), "first": {"stage": k[0], "step": k[1], "dp": k[2], "tp": k[3],
                                                      "parameters": names[:20], "count": len(names),
                                                      "differ_at_that_step": at_step}}
    return {"compared": len(keys), "first": None}


def to_lines(trace: dict) -> list[dict]:
    """:func:`read`'s result as JSON (a reference carried to another machine)."""
    return [{"stage": s, "step": st, "dp": d, "tp": t, "digests": digests} for (s, st, d, t), digests in trace.items()]


def from_lines(lines: list[dict]) -> dict:
    return {(x["stage"], x["step"], x["dp"], x["tp"]): x["digests"] for x in lines}
