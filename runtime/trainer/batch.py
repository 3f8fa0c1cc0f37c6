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
    # rollout.routing_replay: each sample's experts per token and MoE layer as the engine routed them ([tokens - 1,
    # layers, k]: every token but the last, `SampleResult.routed_experts`); None: the trainer routes itself
    routes: list[torch.Tensor] | None = field(default=None)

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, idx: list[int]) -> "TrainBatch":
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        return TrainBatch(pick(self.tokens), pick(self.prompt_lens), pick(self.advantages), pick(self.loss_masks),
                          pick(self.rollout_logprobs), pick(self.old_logprobs), pick(self.routes))

    def response_token_count(self) -> int:
        return sum(sum(m) for m in self.loss_masks)


@dataclass
class PackedMicroBatch:
    """A micro-batch in two layouts.

    The forward layout is what the model sees: ``input_ids``/``position_ids`` [rows, s] and ``targets``
    [rows, s-1] (position t predicts token t+1). Right-padded (:func:`pack`): one sample per row. Packed
    (:func:`pack_varlen`): every sample back to back in one row without padding, positions restarting at 0
    per sample, ``cu_seqlens``/``max_seqlen`` telling attention where samples start.

    The sample layout is what the loss sees, one sample per row, right-padded, [k, S-1] for k samples of
    at most S tokens: ``resp_mask`` (1 where the target is a trained response token), ``advantages``,
    ``rollout_logp``, ``old_logp``. :meth:`to_rows` takes a forward-layout tensor there. For a padded
    micro-batch both layouts are the same."""

    input_ids: torch.Tensor  # [rows, s]
    position_ids: torch.Tensor  # [rows, s]
    targets: torch.Tensor  # [rows, s-1] next tokens
    resp_mask: torch.Tensor  # [k, S-1] float
    advantages: torch.Tensor  # [k, S-1] the sample's advantage on every position
    rollout_logp: torch.Tensor  # [k, S-1]
    old_logp: torch.Tensor | None  # [k, S-1]
    seq_ids: list[int]  # index of each sample in the parent TrainBatch
    cu_seqlens: torch.Tensor | None = None  # [k+1] int32 sample offsets in the packed row (packed only)
    max_seqlen: int | None = None
    row_index: torch.Tensor | None = None  # [k, S-1] flat forward-layout target position of each sample position
    row_valid: torch.Tensor | None = None  # [k, S-1] bool, the sample has that position
    starts: list[tuple[int, int]] = field(default_factory=list)  # (forward row, offset) of each sample
    # the experts each forward position is routed to, [MoE layers, s * rows, k] in the router's token order (the
    # model's [s, rows] flattened: position-major); None: the model routes itself (`runtime/trainer/routing_replay.py`)
    routes: torch.Tensor | None = None
    # expert parallelism: [rows, s] bool, True at the positions that exist only because the micro-batch was padded
    # to its expert group's shape (`runtime/trainer/expert_parallel.py`); the routers' losses skip them. None: no
    # expert parallelism
    group_padding: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A forward-layout [rows, s-1] tensor in the sample layout [k, S-1] (0 past each sample's end)."""
        if not self.packed:
            return x
        return x.reshape(-1)[self.row_index].masked_fill(~self.row_valid, 0)

    def response_select(self, batch: "TrainBatch") -> torch.Tensor:
        """[rows, s-1] bool in the forward layout: every position that predicts a response token."""
        select = torch.zeros(self.targets.shape, dtype=torch.bool)
        for i, (row, start) in zip(self.seq_ids, self.starts):
            select[row, start + batch.prompt_lens[i] - 1: start + len(batch.tokens[i]) - 1] = True
        return select

    def loss_select(self) -> torch.Tensor:
        """[rows, s-1] bool in the forward layout: where ``resp_mask`` > 0."""
        if not self.packed:
            return self.resp_mask > 0
        flat = torch.zeros(self.targets.numel(), dtype=torch.bool, device=self.resp_mask.device)
        flat[self.row_index[self.row_valid & (self.resp_mask > 0)]] = True
        return flat.view(self.targets.shape)


def _sample_rows(batch: TrainBatch, idx: list[int], width: int | None = None):
    """The sample layout's tensors (resp_mask, advantages, rollout_logp, old_logp), [k, S-1] on CPU: S the longest
    sample's length, or ``width`` (a right-padded micro-batch's, whose two layouts are one)."""
    s = width or max(len(batch.tokens[i]) for i in idx)
    b = len(idx)
    mask = torch.zeros(b, s - 1)
    adv = torch.zeros(b, s - 1)
    rlp = torch.zeros(b, s - 1)
    olp = torch.zeros(b, s - 1) if batch.old_logprobs is not None else None
    for row, i in enumerate(idx):
        toks, p = batch.tokens[i], batch.prompt_lens[i]
        n = len(toks) - p
        # target position t predicts token t+1: response token j sits at target index p-1+j
        sl = slice(p - 1, p - 1 + n)
        mask[row, sl] = torch.tensor(batch.loss_masks[i], dtype=torch.float32)
        adv[row, sl] = batch.advantages[i]
        rlp[row, sl] = torch.tensor(batch.rollout_logprobs[i], dtype=torch.float32)
        if olp is not None:
            olp[row, sl] = torch.tensor(batch.old_logprobs[i], dtype=torch.float32)
    return mask, adv, rlp, olp


def _forward_routes(batch: TrainBatch, idx: list[int], rows: int, width: int,
                    starts: list[tuple[int, int]]) -> torch.Tensor | None:
    """The samples' recorded routes in the forward layout's router order ([layers, width * rows, k]). A position no
    route was recorded for (a sample's last token, padding) goes to experts 0..k-1: no log-prob reads its output."""
    if batch.routes is None:
        return None
    first = batch.routes[idx[0]]
    layers, k = first.shape[1], first.shape[2]
    out = torch.arange(k, dtype=torch.long).expand(width, rows, layers, k).clone()
    for i, (row, start) in zip(idx, starts):
        got, need = batch.routes[i], len(batch.tokens[i]) - 1
        if got is None or len(got) < need:
            raise ValueError(f"routing replay: sample {i} of {need + 1} tokens carries routes for "
                             f"{0 if got is None else len(got)} of the {need} it needs")
        out[start:start + need, row] = got[:need].to(torch.long)
    return out.permute(2, 0, 1, 3).reshape(layers, width * rows, k)


def pack(batch: TrainBatch, idx: list[int], device: str | torch.device = "cpu", pad_id: int = 0,
         length: int | None = None) -> PackedMicroBatch:
    """Right-padded: one sample per row, of the longest sample's length, or of ``length`` (expert parallelism: the
    expert group's shape; the positions past the longest sample are ``group_padding``)."""
    own = max(len(batch.tokens[i]) for i in idx)
    s = max(own, length or 0)
    b = len(idx)
    ids = torch.full((b, s), pad_id, dtype=torch.long)
    for row, i in enumerate(idx):
        ids[row, : len(batch.tokens[i])] = torch.tensor(batch.tokens[i])
    mask, adv, rlp, olp = _sample_rows(batch, idx, s)
    pos = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    starts = [(row, 0) for row in range(b)]
    group_padding = None if length is None else (torch.arange(s) >= own).expand(b, s).contiguous()
    return PackedMicroBatch(to(ids), to(pos), to(ids[:, 1:].contiguous()), to(mask), to(adv), to(rlp), to(olp),
                            list(idx), starts=starts, routes=to(_forward_routes(batch, idx, b, s, starts)),
                            group_padding=to(group_padding))


def pack_varlen(batch: TrainBatch, idx: list[int], device: str | torch.device = "cpu",
                length: int | None = None) -> PackedMicroBatch:
    """Packed: the samples back to back in one row of sum(lengths) tokens, no padding; each sample's
    positions start at 0 (RoPE sees what it would unpacked) and ``cu_seqlens`` keeps attention inside it.
    The target of a sample's last token is the next sample's first: never a response position, so never
    selected. ``length`` (expert parallelism: the expert group's shape): the row is filled up to it by one more
    sequence of padding, its own in ``cu_seqlens`` (no sample attends to it), marked as ``group_padding``."""
    lens = [len(batch.tokens[i]) for i in idx]
    total = sum(lens)
    width = max(total, length or 0)
    ids = torch.zeros(1, width, dtype=torch.long)
    ids[0, :total] = torch.tensor([t for i in idx for t in batch.tokens[i]], dtype=torch.long)
    segments = lens + ([width - total] if width > total else [])
    pos = torch.cat([torch.arange(n) for n in segments]).view(1, width)
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(segments), 0)
    mask, adv, rlp, olp = _sample_rows(batch, idx)
    s1 = mask.shape[1]
    j = torch.arange(s1).view(1, s1)
    valid = j < (torch.tensor(lens).view(-1, 1) - 1)
    index = torch.where(valid, cu[:len(idx)].view(-1, 1).to(torch.long) + j, torch.zeros((), dtype=torch.long))
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    starts = [(0, int(o)) for o in cu[:len(idx)].tolist()]
    group_padding = None if length is None else (torch.arange(width) >= total).view(1, width)
    return PackedMicroBatch(to(ids), to(pos), to(ids[:, 1:].contiguous()), to(mask), to(adv), to(rlp), to(olp),
                            list(idx), cu_seqlens=to(cu), max_seqlen=max(segments), row_index=to(index),
                            row_valid=to(valid), starts=starts, routes=to(_forward_routes(batch, idx, 1, width, starts)),
                            group_padding=to(group_padding))


def padding_micro_batch(length: int, device: str | torch.device = "cpu") -> PackedMicroBatch:
    """A packed micro-batch of ``length`` padding tokens and no sample (expert parallelism: a rank with fewer
    micro-batches than its expert group runs these, so the group's collectives pair up). Nothing in it is trained
    on: its loss mask is empty."""
    ids = torch.zeros(1, length, dtype=torch.long)
    zeros = torch.zeros(1, length - 1)
    to = lambda t: t.to(device)  # noqa: E731
    return PackedMicroBatch(to(ids), to(torch.arange(length).view(1, length)), to(ids[:, 1:].contiguous()),
                            to(zeros), to(zeros), to(zeros), None, [],
                            cu_seqlens=to(torch.tensor([0, length], dtype=torch.int32)), max_seqlen=length,
                            row_index=to(torch.zeros(1, length - 1, dtype=torch.long)),
                            row_valid=to(torch.zeros(1, length - 1, dtype=torch.bool)),
                            group_padding=to(torch.ones(1, length, dtype=torch.bool)))


def token_budget_micro_batches(idx: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """``idx`` cut into micro-batches of at most ``max_tokens`` tokens in all: longest first, each sample
    into the first micro-batch with room (first-fit decreasing; deterministic). A sample longer than the
    budget is an error (the config refuses such a budget)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in by_length(list(idx), lengths):
        n = lengths[i]
        if n > max_tokens:
            raise ValueError(f"a sample of {n} tokens is longer than train.max_tokens_per_micro_batch={max_tokens}")
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
    return bins


def step_slices(n_samples: int, steps: int, dp_size: int, dp_rank: int, micro_batch_size: int,
                lengths: list[int] | None = None, max_tokens: int | None = None) -> list[list[list[int]]]:
    """For each optimizer step, this DP rank's micro-batches as lists of sample indices.

    With `lengths` (tokens per sample) a rank's samples of a step are ordered longest first before
    they are cut, so a micro-batch holds samples of similar length and pads little (the loss is
    normalised per step, so the order does not change the update), and the largest micro-batch
    runs first: if it does not fit, that shows at once. With `max_tokens` (needs `lengths`) the
    micro-batches hold at most that many tokens instead of `micro_batch_size` samples
    (:func:`token_budget_micro_batches`)."""
    per_step = n_samples // steps
    per_rank = per_step // dp_size
    out = []
    for s in range(steps):
        start = s * per_step + dp_rank * per_rank
        rank_idx = list(range(start, start + per_rank))
        if max_tokens is not None:
            out.append(token_budget_micro_batches(rank_idx, lengths, max_tokens))
            continue
        rank_idx = by_length(rank_idx, lengths)
        out.append([rank_idx[i: i + micro_batch_size] for i in range(0, per_rank, micro_batch_size)])
    return out


def by_length(idx: list[int], lengths: list[int] | None) -> list[int]:
    """`idx` longest first (ties in index order); unchanged without lengths."""
    return idx if lengths is None else sorted(idx, key=lambda i: (-lengths[i], i))
