"""Keyed, vectorised sampling: the token drawn for a row depends only on its key, never on history.

The resume contract (DESIGN.md) asks that a sample is a pure function of
`(seed, rollout_id, prompt_index, sample_index)`. A `torch.Generator` per row would make that true
but is slow and does not vectorise; the global RNG would make a row depend on which rows came
before it. Instead every random number is a counter-based hash:

    noise[b, v] = hash(key_hash[b], position[b], v)

computed with int64 tensor ops, so it is the same for a row whatever else is in the batch and
costs a handful of elementwise kernels per decode step. The integer hash and the uniforms are
bit-identical on CPU and CUDA (checked on an H100); the Gumbel transform's `log` may differ by
one float32 ulp between devices, far below how much the two devices' logits differ anyway.

The hash is splitmix64 (Steele et al.; the finaliser of `java.util.SplittableRandom`). torch has
no uint64 arithmetic we can rely on everywhere, so it runs on int64: multiplication wraps modulo
2**64 exactly as unsigned multiplication does (two's complement), xor is bitwise, and the one
thing that differs - `>>` on int64 is arithmetic (sign-extending) - is turned into a logical shift
by masking off the copied sign bits.

Tokens are drawn with the Gumbel-max trick: argmax(logits / T + g), g = -log(-log(u)), is an exact
sample from softmax(logits / T). Top-k / top-p filtering sets the excluded logits to -inf first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # only for the annotation; base.py has no import of this module
    from runtime.rollout.base import SamplingParams

_MASK64 = (1 << 64) - 1


def _as_int64(value: int) -> int:
    """A uint64 constant written as the int64 with the same bits (torch has no uint64 scalars here)."""
    value &= _MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


_GOLDEN_GAMMA = _as_int64(0x9E3779B97F4A7C15)  # splitmix64's increment: odd, irrational-ish bits
_MIX_MUL_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_MUL_2 = _as_int64(0x94D049BB133111EB)
# Domain separators: keep the key chain, the position and the vocab stream from colliding.
_KEY_SALT = _as_int64(0x2545F4914F6CDD1D)
_POSITION_SALT = _as_int64(0xD6E8FEB86659FD93)

_NOISE_BITS = 23  # float32 holds 2*k+1 for k < 2**23 exactly, so u never rounds to 0 or 1


def _logical_shift_right(x: torch.Tensor, shift: int) -> torch.Tensor:
    # int64 `>>` copies the sign bit into the top `shift` bits; clearing them gives uint64 `>>`.
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _splitmix64_mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors (bit-identical to the uint64 original)."""
    z = (z ^ _logical_shift_right(z, 30)) * _MIX_MUL_1
    z = (z ^ _logical_shift_right(z, 27)) * _MIX_MUL_2
    return z ^ _logical_shift_right(z, 31)


def sample_key_hash(keys: torch.Tensor) -> torch.Tensor:
    """Hash each row's (seed, rollout_id, prompt_index, sample_index) into one int64.

    keys: LongTensor[B, 4]. Returns LongTensor[B]. Every component goes through the mixer before
    it is combined, so neighbouring keys (sample 0 and 1 of one prompt) give unrelated hashes.
    """
    if keys.dtype != torch.int64 or keys.dim() != 2 or keys.shape[1] != 4:
        raise ValueError(f"keys must be an int64 tensor of shape [B, 4], got {keys.dtype} {tuple(keys.shape)}")
    state = torch.full_like(keys[:, 0], _KEY_SALT)
    for column in range(4):
        component = _splitmix64_mix(keys[:, column] + _as_int64((column + 1) * _GOLDEN_GAMMA))
        state = _splitmix64_mix(state ^ component)
    return state


_VOCAB_COUNTERS: dict[tuple[int, str], torch.Tensor] = {}


def _vocab_counters(vocab: int, device: torch.device) -> torch.Tensor:
    """(v + 1) * gamma for every vocab index, built once per (vocab, device).

    Kept as a stored tensor rather than `arange(...) * gamma` inline: under torch.compile,
    Inductor folds the inline form into int32 index arithmetic and fails on the 64-bit constant
    (torch 2.11, Triton); read from memory, it compiles and stays bit-identical to eager.
    """
    cache_key = (vocab, str(device))
    counters = _VOCAB_COUNTERS.get(cache_key)
    if counters is None:
        counters = (torch.arange(vocab, device=device, dtype=torch.int64) + 1) * _GOLDEN_GAMMA
        _VOCAB_COUNTERS[cache_key] = counters
    return counters


def uniform_noise(key_hash: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform noise in the open interval (0, 1), one value per (row, vocab index).

    key_hash: LongTensor[B] from `sample_key_hash`; position: LongTensor[B], the decode step
    (index of the response token being drawn). Returns float32 [B, vocab] on key_hash's device.
    The values are odd multiples of 2**-24 (23 random bits), so log(u) and log(1-u) are finite.
    """
    if key_hash.shape != position.shape or key_hash.dim() != 1:
        raise ValueError(f"key_hash and position must both be [B], got {tuple(key_hash.shape)} and {tuple(position.shape)}")
    row_state = _splitmix64_mix(key_hash ^ _splitmix64_mix(position.to(torch.int64) + _POSITION_SALT))
    # splitmix64's own stream: the v-th output is mix(state + (v + 1) * gamma).
    bits = _splitmix64_mix(row_state[:, None] + _vocab_counters(vocab, key_hash.device)[None, :])
    top_bits = _logical_shift_right(bits, 64 - _NOISE_BITS)  # the high bits mix best
    return (top_bits * 2 + 1).to(torch.float32) * (2.0 ** -(_NOISE_BITS + 1))


def gumbel_noise(key_hash: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise, float32 [B, vocab]: -log(-log(u)) of `uniform_noise`."""
    return -torch.log(-torch.log(uniform_noise(key_hash, position, vocab)))


_COMPILED_GUMBEL: list = []


def compiled_gumbel_noise():
    """`gumbel_noise` through torch.compile (dynamic batch), for GPU decode loops.

    Measured on an H100 (torch 2.11), batch 256 x vocab 151936: the noise takes 4.4 ms eager and
    0.14 ms compiled, with bit-identical output; a whole `sample_next` step 4.9 -> 0.8 ms (top-p
    adds ~5 ms for its full-vocab sort either way). Only the noise is compiled: Inductor fails on
    the top-p cumsum with a dynamic batch dimension (torch 2.11), so filtering stays eager.
    """
    if not _COMPILED_GUMBEL:
        _COMPILED_GUMBEL.append(torch.compile(gumbel_noise, dynamic=True))
    return _COMPILED_GUMBEL[0]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k set and outside the top-p nucleus to -inf (row-wise).

    `logits` are already temperature-scaled. Top-k keeps every token tied with the k-th largest
    value (a threshold, so the result does not depend on how a sort orders ties). Top-p keeps the
    smallest prefix of the sorted distribution whose mass reaches top_p; the most likely token is
    always kept, so no row is ever empty.
    """
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(logits, dim=-1, descending=True, stable=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p  # the mass of the better tokens already suffices
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_index, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor,
    key_hash: torch.Tensor,
    position: torch.Tensor,
    sampling: "SamplingParams",
    gumbel_fn: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] = gumbel_noise,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. Returns (tokens LongTensor[B], logprobs float32 [B]).

    The log-prob is that of the drawn token under log_softmax(logits / temperature) over the
    *whole* vocabulary, not under the top-k/top-p-renormalised distribution: the trainer
    recomputes log-probs from logits / temperature without filtering, so only this choice makes
    rollout and trainer log-probs comparable (importance ratios, KL). With temperature 0 the row
    is greedy and the log-prob is under the unscaled logits (temperature treated as 1).
    `gumbel_fn` may be `compiled_gumbel_noise()`: same bits, far faster on GPU.
    """
    logits = logits.to(torch.float32)
    greedy = sampling.temperature <= 0.0
    scaled = logits if greedy else logits / sampling.temperature
    logprobs_all = torch.log_softmax(scaled, dim=-1)
    if greedy:
        tokens = torch.argmax(scaled, dim=-1)
    else:
        filtered = filter_logits(scaled, sampling.top_k, sampling.top_p)
        perturbed = filtered + gumbel_fn(key_hash, position, logits.shape[-1])
        tokens = torch.argmax(perturbed, dim=-1)
    logprobs = logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs
