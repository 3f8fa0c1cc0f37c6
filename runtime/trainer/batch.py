"""One rollout's samples as the trainer sees them, and how they are cut into steps, ranks and micro-batches."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainBatch:
    """Samples of one rollout, group-major (a prompt's samples are contiguous)."""

    tokens: list[list[int]]  # prompt + response ids
    prompt_lens: list[int]
    advantages: list[float]
    loss_masks: list[list[int]]  # one entry per response token (0 = not trained on, e.g. tool output)
    rollout_logprobs: list[list[float]]  # engine log-probs of the response tokens
    old_logprobs: list[list[float]] | None = field(default=None)

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, idx: list[int]) -> "TrainBatch":
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        return TrainBatch(pick(self.tokens), pick(self.prompt_lens), pick(self.advantages), pick(self.loss_masks),
                          pick(self.rollout_logprobs), pick(self.old_logprobs))

    def response_token_count(self) -> int:
        return sum(sum(m) for m in self.loss_masks)


@dataclass
class PackedMicroBatch:
    """Right-padded tensors of a micro-batch; `resp_*` are [b, s-1] aligned with next-token predictions."""

    input_ids: torch.Tensor  # [b, s]
    position_ids: torch.Tensor  # [b, s]
    targets: torch.Tensor  # [b, s-1] next tokens
    resp_mask: torch.Tensor  # [b, s-1] float, 1 where the target is a trained response token
    advantages: torch.Tensor  # [b, s-1] the sample's advantage on every position
    rollout_logp: torch.Tensor  # [b, s-1]
    old_logp: torch.Tensor | None  # [b, s-1]
    seq_ids: list[int]  # index of each row in the parent TrainBatch


def pack(batch: TrainBatch, idx: list[int], device: str | torch.device = "cpu", pad_id: int = 0) -> PackedMicroBatch:
    s = max(len(batch.tokens[i]) for i in idx)
    b = len(idx)
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    mask = torch.zeros(b, s - 1)
    adv = torch.zeros(b, s - 1)
    rlp = torch.zeros(b, s - 1)
    olp = torch.zeros(b, s - 1) if batch.old_logprobs is not None else None
    for row, i in enumerate(idx):
        toks, p = batch.tokens[i], batch.prompt_lens[i]
        n = len(toks) - p
        ids[row, : len(toks)] = torch.tensor(toks)
        # target position t predicts token t+1: response token j sits at target index p-1+j
        sl = slice(p - 1, p - 1 + n)
        mask[row, sl] = torch.tensor(batch.loss_masks[i], dtype=torch.float32)
        adv[row, sl] = batch.advantages[i]
        rlp[row, sl] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
        if olp is not None:
            olp[row, sl] = torch.tensor(batch.old_logprobs[i], dtype=torch.float32)
    pos = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return PackedMicroBatch(to(ids), to(pos), to(ids[:, 1:].contiguous()), to(mask), to(adv), to(rlp), to(olp), list(idx))


def step_slices(n_samples: int, steps: int, dp_size: int, dp_rank: int, micro_batch_size: int,
                lengths: list[int] | None = None) -> list[list[list[int]]]:
    """For each optimizer step, this DP rank's micro-batches as lists of sample indices.

    With `lengths` (tokens per sample) a rank's samples of a step are ordered longest first before
    they are cut, so a micro-batch holds samples of similar length and pads little (the loss is
    normalised per step, so the order does not change the update), and the largest micro-batch
    runs first: if it does not fit, that shows at once."""
    per_step = n_samples // steps
    per_rank = per_step // dp_size
    out = []
    for s in range(steps):
        start = s * per_step + dp_rank * per_rank
        rank_idx = by_length(list(range(start, start + per_rank)), lengths)
        out.append([rank_idx[i: i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)])
    return out


def by_length(idx: list[int], lengths: list[int] | None) -> list[int]:
    """`idx` longest first (ties in index order); unchanged without lengths."""
    return idx if lengths is None else sorted(idx, key=lambda i: (-lengths[i], i))
