"""What partial rollout (runtime/grpo/partial.py) asks of the SGLang engine, in SGLang's terms.

Two things, as the built-in engine does them (runtime/rollout/builtin.py):

- **Continuing a sample** (`SampleRequest.prefix_ids`): SGLang keeps no state between requests, so a
  continuation is a new `/generate` whose `input_ids` are the prompt and the sample's tokens so far, with
  `max_new_tokens` cut by the tokens it already has (`max_new_tokens` caps the whole response). SGLang
  prefills prompt + prefix and samples on; the result is the tokens so far (their log-probs as recorded
  when they were made, under older weights) followed by the new ones. A sample whose tokens so far already
  end it (the model's eos or a stop token, or the cap) is not sent at all. With rollout.routing_replay its
  routes so far stand too, and SGLang is asked for those of its last token on only (routes.py).
- **Stopping once enough groups are complete** (`GroupsDone`): every request carries its own `rid`; once
  the answers make `count` groups complete, the client POSTs `/abort_request` for each request still
  running, and SGLang answers each of those `/generate` calls with finish_reason "abort" and the tokens
  it had made, which come back as the sample's tokens so far (finish "abort"). Requests not sent yet are
  not sent: they come back as they were given.

Unlike the built-in engine, where SGLang stops depends on timing: which requests are still running when
the abort arrives, and how many tokens each has by then. So a run is not reproducible bit for bit here, a
resumed one included (the buffer itself is saved and restored exactly). An abort that reaches a server
before the request it names is a no-op there: that request runs to its end and comes back complete.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from runtime.errors import ModelError
from runtime.rollout.base import FinishReason, GroupsDone, SampleRequest, SampleResult, SamplingParams
from runtime.rollout.sglang.http_protocol import Generated, generate_payload
from runtime.rollout.sglang.routes import RouteLayout, kept_routes
from runtime.rollout.sglang.server_process import Server


@dataclass(frozen=True)
class ModelTokens:
    """The model's end-of-sequence token ids, read where SGLang reads them (`eos_token_id` of config.json and
    of generation_config.json). SGLang stops a request on them whatever `stop_token_ids` says; the client
    needs them to tell a carried sample that ended in eos (finished: not sent again) from one that was cut."""

    eos_ids: frozenset[int]
    model_dir: str

    @classmethod
    def read(cls, model_dir: str) -> "ModelTokens":
        found: set[int] = set()
        for name in ("config.json", "generation_config.json"):
            path = Path(model_dir) / name
            if not path.is_file():  # a hub id, or a model without generation_config.json
                continue
            try:
                value = json.loads(path.read_text()).get("eos_token_id")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(value, int):
                found.add(value)
            elif isinstance(value, list):
                found.update(int(v) for v in value if isinstance(v, int))
        return cls(eos_ids=frozenset(found), model_dir=str(model_dir))

    def stop_ids(self, sampling: SamplingParams) -> set[int]:
        """The tokens that end a response under `sampling`; asked only when a sample is continued."""
        if not self.eos_ids:
            raise ModelError(f"continuing a sample on SGLang needs the model's eos token ids, and {self.model_dir} "
                             f"names none (eos_token_id in config.json or generation_config.json): point the "
                             f"engine at a local HF checkpoint directory that has them")
        return set(self.eos_ids) | set(sampling.stop_token_ids)


@dataclass(frozen=True)
class Continuation:
    """One request of a generate call as the client sends it: the sample's tokens so far (cut to the cap, as
    the built-in engine cuts them), how many more SGLang may add, or why it is finished already. With
    rollout.routing_replay (`layout`): the routes that stand for those tokens (routes.py)."""

    request: SampleRequest
    tokens: list[int]       # the response so far (empty for a new sample)
    logprobs: list[float]   # theirs, as recorded when they were made
    budget: int             # max_new_tokens left for SGLang: the cap minus the tokens so far
    finished: FinishReason | None  # "stop" / "length" when the tokens so far end the response: nothing to send
    layout: RouteLayout | None = None    # rollout.routing_replay on a mixture of experts, else None
    routes: torch.Tensor | None = None   # the routes kept: the prompt's and the tokens so far but the last

    @classmethod
    def of(cls, request: SampleRequest, sampling: SamplingParams, model: ModelTokens,
           layout: RouteLayout | None = None) -> "Continuation":
        cap = sampling.max_new_tokens
        tokens, logprobs = list(request.prefix_ids[:cap]), list(request.prefix_logprobs[:cap])
        finished: FinishReason | None = None
        if tokens and tokens[-1] in model.stop_ids(sampling):
            finished = "stop"
        elif len(tokens) >= cap:
            finished = "length"
        routes = kept_routes(request.prefix_routes, len(request.prompt_ids), len(tokens)) if layout else None
        return cls(request=request, tokens=tokens, logprobs=logprobs, budget=cap - len(tokens), finished=finished,
                   layout=layout, routes=routes)

    @property
    def routes_from(self) -> int | None:
        """The first position whose route SGLang is asked for: the first the sample has none for."""
        if self.layout is None:
            return None
        return 0 if self.routes is None else len(self.routes)

    def payload(self, sampling: SamplingParams) -> dict:
        """The `/generate` body: prompt + tokens so far as input_ids, the budget as max_new_tokens, the key's
        seed (the noise of a position is SGLang's to choose; see http_protocol.py on determinism)."""
        return generate_payload(self.request.key, list(self.request.prompt_ids) + self.tokens,
                                replace(sampling, max_new_tokens=self.budget), routes_from=self.routes_from)

    def result(self, got: Generated, server_index: int = 0) -> SampleResult:
        """The whole response: the tokens so far, then what SGLang added. `text` is SGLang's text of the added
        tokens only (the client has no tokenizer); partial rollout decodes whole responses itself."""
        routes = self.routes
        if self.layout is not None and got.ids:  # (an abort before its first token ran nothing: no routes)
            inputs = len(self.request.prompt_ids) + len(self.tokens) + len(got.ids) - 1
            new = self.layout.decode(got.routed_experts, inputs - self.routes_from, server_index)
            routes = new if routes is None else torch.cat([routes, new])
        return self._result(self.tokens + got.ids, self.logprobs + got.logprobs, got.finish, got.text, routes)

    def as_given(self) -> SampleResult:
        """Not sent: finished already, or enough groups were complete before it was (then "abort")."""
        return self._result(list(self.tokens), list(self.logprobs), self.finished or "abort", "", self.routes)

    def _result(self, ids: list[int], logprobs: list[float], finish: FinishReason, text: str,
                routes: torch.Tensor | None) -> SampleResult:
        return SampleResult(prompt_ids=list(self.request.prompt_ids), response_ids=ids, response_logprobs=logprobs,
                            text=text, finish_reason=finish, routed_experts=routes)


@dataclass
class GroupsWatch:
    """Of one generate call: which requests are complete, which are running on which server under which rid,
    and whether `until` is reached. Touched only from the engine's event loop, so it needs no lock."""

    until: GroupsDone | None
    done: list[bool]  # per request, in request order: finished (stop or length)
    running: dict[int, tuple[Server, str]] = field(default_factory=dict)  # request index -> (server, rid)
    reached: bool = False

    def __post_init__(self) -> None:
        self.reached = self.until is not None and self.until.reached(self.done)

    def sending(self, index: int, server: Server, rid: str) -> None:
        self.running[index] = (server, rid)

    def settled(self, index: int) -> None:
        self.running.pop(index, None)

    def complete(self, index: int) -> list[tuple[Server, str]]:
        """Request `index` finished. When that makes `until` reached: the requests still running, to abort
        (returned once; later sends are refused by `reached`)."""
        self.done[index] = True
        if self.reached or self.until is None or not self.until.reached(self.done):
            return []
        self.reached = True
        return [where for i, where in self.running.items() if not self.done[i]]
