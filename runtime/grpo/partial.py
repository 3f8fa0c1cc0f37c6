"""Partial rollout: keep `over_sampling_factor` x `rollout_batch_size` groups generating, stop once
`rollout_batch_size` of them are complete (and kept by dynamic sampling), and carry the rest over.

What is carried over (the buffer) is run state: the extra complete groups, scored, and the unfinished ones
with each sample's tokens so far, their log-probs as the engine recorded them, and the weight version that
made each run of tokens. It is saved in the checkpoint (JSON in its state) and goes first in the next
rollout, where the unfinished samples are continued under the new weights (the engine prefills prompt +
tokens so far; the noise of token i stays that of (key, i)). A buffered group with tokens older than
`rollout.max_staleness` weight versions is dropped. On the built-in engine where a rollout stops depends only
on the prompts, keys, weights and settings (`GroupsDone`), so a resumed run collects exactly what an unbroken
one does. On SGLang (runtime/rollout/sglang/partial.py: continued by prefilling prompt + tokens so far, cut by
`/abort_request`) it depends on timing: the buffer is saved and restored exactly, but no run is bitwise
reproducible there.

Every prompt drawn ends in exactly one of: trained, filtered (dynamic sampling), stale (dropped) or buffered;
`PartialCounts` keeps the running totals, also in the checkpoint.
"""
from __future__ import annotations

import base64
import math
import time
from dataclasses import asdict, dataclass, field

import torch

from runtime.grpo.rollout_batch import Group
from runtime.rollout.base import GroupsDone, SampleRequest, SampleResult, keyed_requests


@dataclass
class Carried:
    """One sample of a buffered group: its response so far and the weight version of each run of tokens."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = "abort"
    versions: list[list[int]] = field(default_factory=list)  # [[version, tokens], ...] in token order
    # rollout.routing_replay: the engine's routes so far (`SampleResult.routed_experts`), as JSON (`encode_routes`)
    routes: dict | None = None

    def extend(self, result: SampleResult, version: int) -> None:
        new = len(result.response_ids) - len(self.ids)
        if new > 0:
            self.versions.append([version, new])
        self.ids, self.logprobs = list(result.response_ids), list(result.response_logprobs)
        self.finish = result.finish_reason
        self.routes = encode_routes(result.routed_experts)

    @property
    def oldest(self) -> int | None:
        return self.versions[0][0] if self.versions else None


@dataclass
class PendingGroup:
    prompt: dict  # the dataset row plus "prompt_ids"
    keys: list[list[int]]
    samples: list[Carried]
    rewards: list[float] = field(default_factory=list)  # set once complete and scored

    @property
    def complete(self) -> bool:
        return all(s.finish != "abort" for s in self.samples)

    @property
    def oldest(self) -> int | None:
        found = [s.oldest for s in self.samples if s.oldest is not None]
        return min(found) if found else None

    def requests(self) -> list[SampleRequest]:
        return [SampleRequest(prompt_ids=self.prompt["prompt_ids"], key=tuple(k), prefix_ids=s.ids,
                              prefix_logprobs=s.logprobs, prefix_routes=decode_routes(s.routes))
                for k, s in zip(self.keys, self.samples)]

    def as_group(self, decode) -> Group:
        samples = [SampleResult(prompt_ids=list(self.prompt["prompt_ids"]), response_ids=s.ids,
                                response_logprobs=s.logprobs, text=decode(s.ids), finish_reason=s.finish,
                                routed_experts=decode_routes(s.routes))
                   for s in self.samples]
        return Group(prompt=self.prompt, samples=samples, rewards=list(self.rewards))

    @classmethod
    def from_state(cls, d: dict) -> "PendingGroup":
        return cls(prompt=d["prompt"], keys=d["keys"], samples=[Carried(**s) for s in d["samples"]],
                   rewards=d.get("rewards", []))


def encode_routes(routes: torch.Tensor | None) -> dict | None:
    """A sample's routes as JSON for the run state: dtype, shape and the bytes in base64 (one byte an index up to 256
    experts: a buffered sample of the 30B-A3B shape holds ~0.5 KB of routes a token)."""
    if routes is None:
        return None
    return {"dtype": str(routes.dtype).removeprefix("torch."), "shape": list(routes.shape),
            "data": base64.b64encode(routes.contiguous().numpy().tobytes()).decode("ascii")}


def decode_routes(d: dict | None) -> torch.Tensor | None:
    if d is None:
        return None
    raw, dtype = base64.b64decode(d["data"]), getattr(torch, d["dtype"])
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(d["shape"]) if raw else torch.zeros(d["shape"], dtype=dtype)


@dataclass
class PartialCounts:
    """Running totals over the run (prompts), saved with the buffer."""

    drawn: int = 0
    trained: int = 0
    filtered: int = 0
    stale: int = 0


@dataclass
class PartialResult:
    groups: list[Group]  # exactly rollout_batch_size, to train on
    trained_pending: list[PendingGroup]  # the same groups as carried: each sample's weight version per run of tokens
    completed: list[Group]  # every group completed in this rollout (for the reward metrics)
    state: dict  # {"buffer": [...], "counts": {...}}: run state for the next rollout
    cursor: dict
    filtered: int
    reward_failures: int
    new_tokens: int
    generate_s: float
    reward_s: float
    metrics: dict


def collect_partial(collector, rollout_id: int, cursor: dict, state: dict | None) -> PartialResult:
    """One rollout with partial rollout on. `state`: {"buffer": [...], "counts": {...}} from the last
    rollout (None at the start of a run). The weights generating now are version `rollout_id`."""
    cfg = collector.cfg
    r = cfg.rollout
    n, need = r.n_samples_per_prompt, r.rollout_batch_size
    in_flight = max(need, math.ceil(need * r.over_sampling_factor))
    state = state or {}
    counts = PartialCounts(**state.get("counts", {}))
    carried = [PendingGroup.from_state(d) for d in state.get("buffer", [])]
    is_stale = [g.oldest is not None and rollout_id - g.oldest > r.max_staleness for g in carried]
    stale = [g for g, x in zip(carried, is_stale) if x]
    carried = [g for g, x in zip(carried, is_stale) if not x]
    counts.stale += len(stale)
    reused_tokens = sum(len(s.ids) for g in carried for s in g.samples)
    age = [rollout_id - g.oldest for g in carried if g.oldest is not None]

    def decode(ids: list[int]) -> str:
        return collector.tokenizer.decode(ids, skip_special_tokens=True)

    # complete extras of the last rollout were scored (and kept) then
    kept = [(g, g.as_group(decode)) for g in carried if g.complete]
    pending = [g for g in carried if not g.complete]
    filtered: list[tuple[PendingGroup, Group]] = []
    completed: list[Group] = []
    drawn_here = draws = new_tokens = failures = 0
    generate_s = reward_s = 0.0
    while len(kept) < need:
        short = in_flight - len(kept) - len(pending)
        if short > 0 and draws < r.max_draws:
            rows, cursor = collector.dataset.batch(cursor, short)
            draws += 1
            prompts = [{**row, "prompt_ids": collector.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]}
                       for row in rows]
            keys = keyed_requests([p["prompt_ids"] for p in prompts], seed=cfg.train.seed, slot=rollout_id, n=n,
                                  first_prompt=drawn_here)
            pending += [PendingGroup(prompt=p, keys=[list(q.key) for q in ks], samples=[Carried() for _ in ks])
                        for p, ks in zip(prompts, keys)]
            drawn_here += len(prompts)
            counts.drawn += len(prompts)
        if not pending:
            break
        t0 = time.time()
        results = collector.engine.generate([q for g in pending for q in g.requests()], collector.sampling,
                                            GroupsDone(n, need - len(kept)))
        t1 = time.time()
        for i, g in enumerate(pending):
            for s, res in zip(g.samples, results[i * n:(i + 1) * n]):
                before = len(s.ids)
                s.extend(res, rollout_id)
                new_tokens += len(s.ids) - before
        done = [(g, g.as_group(decode)) for g in pending if g.complete]
        pending = [g for g in pending if not g.complete]
        failures += collector.score([grp for _, grp in done])
        generate_s, reward_s = generate_s + t1 - t0, reward_s + time.time() - t1
        for g, grp in done:
            g.rewards = list(grp.rewards)
            completed.append(grp)
            (kept if not r.dynamic_sampling or grp.informative else filtered).append((g, grp))
    if len(kept) < need:  # draws exhausted: uninformative groups fill the batch (zero advantage)
        fill = filtered[:need - len(kept)]
        kept += fill
        filtered = filtered[len(fill):]
    trained, extra = kept[:need], kept[need:]
    counts.trained += len(trained)
    counts.filtered += len(filtered)
    buffer = [asdict(g) for g, _ in extra] + [asdict(g) for g in pending]
    metrics = {"partial_buffered_groups": len(buffer),
               "partial_buffered_samples": sum(s.finish == "abort" for g in pending for s in g.samples),
               "partial_stale_dropped": len(stale),
               "partial_stale_tokens": sum(len(s.ids) for g in stale for s in g.samples),  # made, never trained
               "partial_tokens_reused": reused_tokens,
               # trained samples made under two or more weight versions: carried unfinished, continued, trained
               "partial_samples_continued": sum(len(s.versions) > 1 for g, _ in trained for s in g.samples),
               "partial_tokens_generated": new_tokens,
               "partial_buffer_age_mean": sum(age) / len(age) if age else 0.0,
               **{f"partial_prompts_{k}": v for k, v in asdict(counts).items()}}
    return PartialResult(groups=[grp for _, grp in trained], trained_pending=[g for g, _ in trained],
                         completed=completed, state={"buffer": buffer, "counts": asdict(counts)}, cursor=cursor,
                         filtered=len(filtered), reward_failures=failures, new_tokens=new_tokens, generate_s=generate_s,
                         reward_s=reward_s, metrics=metrics)
