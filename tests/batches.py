"""Random training batches for the trainer's parallel-equivalence tests."""
import torch

from runtime.trainer.batch import TrainBatch


def ragged_batch(vocab: int, n: int, seed: int = 0, lengths=None) -> TrainBatch:
    """Samples of ragged lengths: prompt 5..7 and response 3..8 tokens unless ``lengths`` gives (prompt, response)
    per sample; random tokens, advantages and engine log-probs from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tokens, prompt_lens, masks, rlp = [], [], [], []
    for i in range(n):
        p, r = lengths[i] if lengths else (5 + i % 3, 3 + (i * 7) % 6)
        tokens.append(torch.randint(3, vocab, (p + r,), generator=g).tolist())
        prompt_lens.append(p)
        masks.append([1] * r)
        rlp.append((-torch.rand(r, generator=g) * 4).tolist())
    return TrainBatch(tokens, prompt_lens, torch.randn(n, generator=g).tolist(), masks, rlp)
