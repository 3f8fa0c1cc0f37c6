"""SGLang's HTTP API as the client speaks it: request bodies, response parsing, errors, one POST.

For SGLang >=0.5.17,<0.6 (settings.SUPPORTED_SGLANG). Read from SGLang **0.5.23** (the PyPI wheel `sglang-0.5.23`,
built 2026-10-30), which tests/sglang_standin.py speaks; run against a real **0.5.17** server on an H200
(bench/sglang_real.py), whose endpoints and fields used here are the same. What differs: 0.5.17 has no `/generate`
contract check, so an unknown sampling key is an uncaught TypeError there (a 500 "Internal Server Error", the
traceback in its log, the server up), where 0.5.23 answers 400 (both are RequestRejected, engine_pool.py); and routes the client does not call
(`/get_weight_version` only in 0.5.17; `/ready`, `/begin_weight_update`, `/end_weight_update` only in 0.5.23).

- `sglang/srt/entrypoints/http_server.py`: routes `/health_generate`, `/generate`, `/flush_cache`,
  `/update_weights_from_disk`, `/update_weights_from_tensor`, `/init_weights_update_group`,
  `/destroy_weights_update_group`, `/update_weights_from_distributed`, `/release_memory_occupation`,
  `/resume_memory_occupation`; their status codes (400 with `{"success": false, "message"}` or
  `{"error": {"message"}}`).
- `sglang/srt/managers/io_struct.py`: `GenerateReqInput` (`input_ids`, `sampling_params`,
  `return_logprob`, `logprob_start_len`, `rid`; `return_routed_experts`, `routed_experts_start_len`, read from
  0.5.17: routes.py), `UpdateWeightFromDiskReqInput` (`model_path`,
  `weight_version`, `flush_cache`, `abort_all_requests`), `UpdateWeightsFromTensorReqInput`
  (`serialized_named_tensors`: one base64 ForkingPickler payload per TP rank),
  `UpdateWeightsFromDistributedReqInput` (`names`, `dtypes`, `shapes`, `group_name`,
  `weight_version`, `flush_cache`), `InitWeightsUpdateGroupReqInput` (`master_address`,
  `master_port`, `rank_offset`, `world_size`, `group_name`, `backend`),
  `DestroyWeightsUpdateGroupReqInput` (`group_name`), `Release/ResumeMemoryOccupationReqInput`
  (`tags`: `weights`, `kv_cache`; none = all).
- `sglang/api/v1/api_types.py`: the JSON contract of `/generate` - `SamplingParams` rejects
  unknown keys; `GenerateMetaInfo` has `finish_reason`, `completion_tokens`, `weight_version`,
  `output_token_logprobs` / `input_token_logprobs` as `[logprob, token_id, text]` lists.
- `sglang/srt/managers/schedule_batch.py`: `finish_reason` is `{"type": "stop", "matched": id}`,
  `{"type": "length", "length": n}` or `{"type": "abort", "message": ...}`; the matched stop
  token is part of `output_ids` (our contract: the response includes its stop token).
- `/abort_request` takes `AbortReq` (`rid`, `abort_all`) and answers 200 with an empty body; an unknown
  or finished rid is a no-op (`tokenizer_manager.abort_request`). The `/generate` call of an aborted
  request then answers 200 with `finish_reason` type "abort" and the tokens it had made
  (`output_ids`, `output_token_logprobs`); only aborts that carry a status code (400: a bad request,
  500/503) become HTTP errors.

Keyed randomness: every request carries `sampling_params.sampling_seed`, a 64-bit hash of its key
`(seed, rollout_id, prompt_index, sample_index)`. SGLang's sampler (`srt/layers/sampler.py`,
`srt/sampling/sampling_batch_info.py`) uses it - per request and per position, so independent of
batch neighbours and of retries - only when the server runs with `--enable-deterministic-inference`
(`rollout.sglang.deterministic`, on by default; it costs throughput). Then a resumed run or a
retried request draws the same tokens as far as SGLang's deterministic mode promises; without it
the seed is sent but ignored and samples are not reproducible. The returned log-probs are SGLang's
default: log_softmax(logits / temperature) of the sampled token (temperature 0 -> 1), as in the
built-in engine.
"""

from __future__ import annotations

import hashlib
import json
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from runtime.errors import ConfigError
from runtime.rollout.base import FinishReason, SamplingParams
from runtime.rollout.sglang.settings import SUPPORTED_SGLANG


class SGLangError(RuntimeError):
    """The SGLang servers did something the client cannot work with (a protocol or consistency fault)."""


class EngineFault(Exception):
    """A request failed in a way that says something about the server (transport, timeout, 5xx)."""


class ErrorAnswer(EngineFault):
    """The server answered 500 (an exception it did not catch): its fault, or the request's. SGLang 0.5.17 has no
    `/generate` contract check, so an unknown sampling key is a `TypeError` there, a 500 with the body
    "Internal Server Error" and the traceback in its log. The server is checked: one that is healthy rejected
    the request (RequestRejected), else it is restarted. `log_from`: the size of its log when the request went."""

    def __init__(self, message: str, path: str, detail: str, log_from: int | None = None):
        super().__init__(message)
        self.path, self.detail, self.log_from = path, detail, log_from


class RequestRejected(ConfigError, SGLangError):
    """A healthy server refused a request (a 4xx, or a 500 it answered and stayed healthy): the request is at
    fault, so it is neither retried nor taken for a server fault. One line for the user (a ConfigError)."""


class StaleWeights(EngineFault):
    """The server answered with another weight_version than the one it must serve: restart and re-sync it."""


class Aborted(Exception):
    """SGLang aborted a request the client did not ask it to abort (finish_reason type "abort"); worth a retry."""


@dataclass(frozen=True)
class Generated:
    """What one `/generate` answer added to a sample: the new token ids, their log-probs, SGLang's text of
    them, and why it ended ("abort": cut by `/abort_request`, with the tokens made until then)."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish: FinishReason
    routed_experts: str | None = None  # meta_info["routed_experts"] as SGLang sent it (base64; routes.py decodes it)


def sampling_seed_for(key: tuple[int, int, int, int]) -> int:
    """The int64 `sampling_seed` of a request key (seed, rollout_id, prompt_index, sample_index)."""
    digest = hashlib.blake2b(struct.pack("<4q", *key), digest_size=8, person=b"grpoflow-sglang").digest()
    return int.from_bytes(digest, "little", signed=True)


def sglang_sampling_params(sampling: SamplingParams, seed: int) -> dict:
    params = {
        "temperature": float(sampling.temperature),
        "top_p": float(sampling.top_p),
        "top_k": int(sampling.top_k),
        "max_new_tokens": int(sampling.max_new_tokens),
        "sampling_seed": int(seed),
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in sampling.stop_token_ids]
    return params


def generate_payload(key: tuple[int, int, int, int], input_ids: list[int], sampling: SamplingParams,
                     routes_from: int | None = None) -> dict:
    """The `/generate` body for one sample (GenerateReqInput, single-prompt form): `input_ids` is the prompt,
    or the prompt and the response so far for a continued sample. The `rid` names the key (tests and the
    server logs read it) plus a fresh suffix, so every attempt can be aborted on its own. `routes_from`
    (rollout.routing_replay): ask for the experts of every input position from there on (routes.py)."""
    body = {
        "rid": f"gf-{key[0]}-{key[1]}-{key[2]}-{key[3]}-{uuid.uuid4().hex[:8]}",
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": sglang_sampling_params(sampling, sampling_seed_for(key)),
        "return_logprob": True,
    }
    if routes_from is not None:
        body["return_routed_experts"] = True
        body["routed_experts_start_len"] = int(routes_from)
    return body


def abort_payload(rid: str) -> dict:
    """The `/abort_request` body (AbortReq) that aborts one request."""
    return {"rid": rid}


def logprobs_payload(prompt_ids: list[int], response_ids: list[int], temperature: float) -> dict:
    """A `/generate` body that scores prompt + response (input log-probs from position 0, one new token)."""
    return {
        "rid": f"gf-logprobs-{uuid.uuid4().hex[:8]}",
        "input_ids": list(prompt_ids) + list(response_ids),
        "sampling_params": {"max_new_tokens": 1, "temperature": temperature if temperature > 0 else 1.0,
                            "sampling_seed": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }


def parse_logprobs(body: Any, server_index: int, response_ids: list[int],
                   expected_version: str | None = None) -> list[float]:
    """The response tokens' log-probs from the answer to a `logprobs_payload`; an EngineFault when the
    server reports another weight_version than `expected_version` (checked, then retried or restarted)."""
    meta = body.get("meta_info", {}) if isinstance(body, dict) else {}
    if expected_version is not None and str(meta.get("weight_version")) != expected_version:
        raise EngineFault(f"engine {server_index} reports weight_version {meta.get('weight_version')!r}, "
                           f"expected {expected_version!r}")
    entries = meta.get("input_token_logprobs") or []
    tail = entries[-len(response_ids):] if len(entries) >= len(response_ids) else []
    if [int(x[1]) for x in tail] != list(response_ids) or any(x[0] is None for x in tail):
        raise SGLangError(f"SGLang engine {server_index} returned input_token_logprobs that do not line up with the "
                          f"input (got ids {[x[1] for x in entries][-8:]}, wanted {list(response_ids)[-8:]})")
    return [float(x[0]) for x in tail]


def error_message(body: Any, fallback: str) -> str:
    """SGLang's error text from a response body: {"error": {"message"}}, {"error": "..."}, {"message"}."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("message"):
            return str(body["message"])
        if body.get("detail"):
            return str(body["detail"])
    if isinstance(body, str) and body.strip():
        return body.strip()
    return fallback


def parse_generated(body: Any, expected_version: str | None = None, *, abort_ok: bool = False) -> Generated:
    """The new tokens of a `/generate` answer. An abort is Aborted unless `abort_ok` (the client cut the
    request short itself: its tokens so far are the result); StaleWeights, or SGLangError on a malformed one."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise SGLangError(f"SGLang /generate answered without meta_info: {str(body)[:200]}")
    meta = body["meta_info"]
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind == "abort" and not abort_ok:
        raise Aborted(error_message(finish, "aborted"))
    if kind not in ("stop", "length", "abort"):
        raise SGLangError(f"SGLang /generate finished with finish_reason={finish!r}; expected stop or length")
    entries = meta.get("output_token_logprobs")
    if entries is None and kind == "abort" and not body.get("output_ids"):
        entries = []  # aborted before its first token: nothing to score
    if not isinstance(entries, list):
        raise SGLangError("SGLang /generate answered without meta_info.output_token_logprobs (was return_logprob sent?)")
    logprobs = [float(e[0]) for e in entries]
    ids_from_logprobs = [int(e[1]) for e in entries]
    output_ids = body.get("output_ids")
    response_ids = [int(t) for t in output_ids] if output_ids is not None else ids_from_logprobs
    if response_ids != ids_from_logprobs:
        raise SGLangError(f"SGLang output_ids {response_ids[:8]}... disagree with output_token_logprobs ids "
                          f"{ids_from_logprobs[:8]}...")
    completion = meta.get("completion_tokens")
    if completion is not None and int(completion) != len(response_ids):
        raise SGLangError(f"SGLang completion_tokens={completion} but {len(response_ids)} output tokens came back")
    if expected_version is not None and meta.get("weight_version") is not None and str(meta["weight_version"]) != expected_version:
        raise StaleWeights(f"engine serves weight_version {meta['weight_version']!r}, expected {expected_version!r}")
    return Generated(ids=response_ids, logprobs=logprobs, text=body.get("text") or "", finish=kind,
                     routed_experts=meta.get("routed_experts"))


SENT_SAMPLING_KEYS = "temperature, top_p, top_k, max_new_tokens, stop_token_ids, sampling_seed"
MAX_SERVER_MESSAGE = 300  # characters of a server's error text kept in an error line


def rejected_request(server_index: int, path: str, status: int, message: str) -> RequestRejected:
    """The one-line error for a request a healthy server refused: the endpoint, SGLang's message (trimmed) and
    the fix. For `/generate` the request carries SGLang's sampling keys from the rollout config's values."""
    message = " ".join(str(message).split())
    if len(message) > MAX_SERVER_MESSAGE:
        message = message[:MAX_SERVER_MESSAGE - 1] + "…"
    fix = (f"it carries SGLang's sampling keys ({SENT_SAMPLING_KEYS}) with rollout's (or eval's) temperature, top_p, "
           f"top_k and max_new_tokens, and the prompt's token ids: check those values, and that rollout.sglang.launch "
           f"runs SGLang {SUPPORTED_SGLANG}, the releases this client speaks to"
           if path == "/generate" else
           f"check that rollout.sglang.launch runs SGLang {SUPPORTED_SGLANG}, the releases this client speaks to")
    healthy = ", and it stays healthy" if status >= 500 else ""
    return RequestRejected(f"SGLang engine {server_index} rejected {path} ({status}{healthy}): {message}. The request "
                           f"is at fault, not the server: not resent, no restart. Fix: {fix}")


async def post(client, base_url: str, path: str, body: Any, timeout: float, server_index: int,
               log_from: int | None = None) -> Any:
    """POST to one server. 2xx -> parsed JSON (or text); a 4xx on `/generate` -> RequestRejected, on another
    endpoint SGLangError, either with SGLang's message; `"success": false` -> SGLangError; a 500 -> ErrorAnswer
    (checked by the caller: the request's fault or the server's); transport errors, timeouts and other 5xx ->
    EngineFault. `log_from`: the size of the server's log before the request (read back for a 500)."""
    import httpx
    try:
        r = await client.post(base_url + path, json=body, timeout=timeout)
    except httpx.TimeoutException as exc:
        raise EngineFault(f"{path} timed out after {timeout:.0f}s ({type(exc).__name__})") from exc
    except httpx.TransportError as exc:
        raise EngineFault(f"{path}: {type(exc).__name__}: {exc}") from exc
    try:
        payload = r.json()
    except (json.JSONDecodeError, ValueError):
        payload = r.text
    message = error_message(payload, r.reason_phrase)
    if r.status_code == 500:
        raise ErrorAnswer(f"{path} answered 500: {message}", path, message, log_from)
    if r.status_code >= 500:
        raise EngineFault(f"{path} answered {r.status_code}: {message}")
    if r.status_code >= 400 and path == "/generate":
        raise rejected_request(server_index, path, r.status_code, message)
    if r.status_code >= 400:
        raise SGLangError(f"SGLang engine {server_index} rejected {path} ({r.status_code}): {message}")
    if isinstance(payload, dict) and payload.get("success") is False:
        raise SGLangError(f"SGLang engine {server_index} {path} failed: {error_message(payload, 'success=false')}")
    return payload
