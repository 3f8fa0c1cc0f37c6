"""The built-in learnable task: one-digit arithmetic, generated deterministically in slime's jsonl schema.

It exists so that a tiny random-init transformer (2 layers, each digit its own token) shows a rising
reward within minutes of GRPO on a CPU: every answer is a single digit 0–9 (one token, graded by
math-verify from a short response), prompts are a handful of tokens, and the easiest operation
(copy) pays a reward as soon as the policy learns to repeat the digit it sees.

The problem space is small (120 problems at the default difficulty), so train rows repeat problems
(the train file is a stream of draws, like epochs) while eval lists each held-out problem once.
Which split a problem belongs to depends only on the problem itself (a hash of its key), never on
the seed, size or difficulty, so train and eval are disjoint for any combination of those.
"""
from __future__ import annotations

import hashlib
import json
import random
from typing import Sequence

from runtime import storage

SOURCE = "builtin://arith"
DEFAULT_SEED = 0
DEFAULT_SIZES = {"train": 2000, "eval": 64}
EVAL_PERCENT = 25  # share of the problem space held out for eval

OPS = ("copy", "add", "sub")
# The difficulty knob: which operations appear. "copy" alone is nearly free to learn (the answer is in
# the prompt); "add"/"sub" need the model to combine two digits.
DIFFICULTIES: dict[str, tuple[str, ...]] = {
    "copy": ("copy",),
    "easy": ("copy", "add"),
    "default": ("copy", "add", "sub"),
    "hard": ("add", "sub"),
}


def resolve_ops(difficulty: str | Sequence[str]) -> tuple[str, ...]:
    """A difficulty preset name, or an explicit list of operations, as a tuple of operations."""
    if isinstance(difficulty, str):
        if difficulty in DIFFICULTIES:
            return DIFFICULTIES[difficulty]
        difficulty = [p for p in difficulty.split(",") if p]
    ops = tuple(dict.fromkeys(difficulty))  # dedupe, keep order
    bad = [op for op in ops if op not in OPS]
    if bad or not ops:
        raise ValueError(f"arith difficulty {difficulty!r}: use one of {', '.join(DIFFICULTIES)} "
                         f"or a comma list of {', '.join(OPS)}")
    return ops


def _problems(op: str) -> list[tuple[str, int, int, int]]:
    """All problems of one operation as (op, a, b, answer), answers restricted to 0..9."""
    if op == "copy":
        return [("copy", a, 0, a) for a in range(10)]
    if op == "add":
        return [("add", a, b, a + b) for a in range(10) for b in range(10) if a + b <= 9]
    if op == "sub":
        return [("sub", a, b, a - b) for a in range(10) for b in range(10) if a >= b]
    raise ValueError(f"unknown arith op {op!r}")


def _key(op: str, a: int, b: int) -> str:
    return f"{op}-{a}" if op == "copy" else f"{op}-{a}-{b}"


def split_of(op: str, a: int, b: int) -> str:
    """'train' or 'eval' for one problem; fixed forever so that the two splits never overlap."""
    digest = hashlib.sha256(f"grpoflow-arith-split:{_key(op, a, b)}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % 100 < EVAL_PERCENT else "train"


def _prompt(op: str, a: int, b: int) -> str:
    if op == "copy":
        return f"copy {a} = ?"
    return f"{a} {'+' if op == 'add' else '-'} {b} = ?"


def _row(op: str, a: int, b: int, answer: int, split: str) -> dict:
    meta = {"source": SOURCE, "split": split, "id": _key(op, a, b), "op": op, "a": a}
    if op != "copy":
        meta["b"] = b
    return {"prompt": _prompt(op, a, b), "label": str(answer), "metadata": meta}


def generate_arith(split: str, n: int | None = None, seed: int = DEFAULT_SEED,
                   difficulty: str | Sequence[str] = "default") -> list[dict]:
    """``n`` rows of the given split as slime jsonl records ``{"prompt", "label", "metadata"}``.

    train: ``n`` draws (default 2000) — pick an operation uniformly, then one of its train problems —
    so easy operations with few problems (copy) still make up their share of the stream.
    eval: each held-out problem once, in a seeded order, at most ``n`` (default 64) of them.
    """
    if split not in DEFAULT_SIZES:
        raise ValueError(f"arith split {split!r}: use train or eval")
    n = DEFAULT_SIZES[split] if n is None else n
    if n < 0:
        raise ValueError(f"arith n={n}: must be >= 0")
    ops = resolve_ops(difficulty)
    pools = {op: [p for p in _problems(op) if split_of(*p[:3]) == split] for op in ops}
    rng = random.Random(f"grpoflow-arith:{split}:{seed}")
    if split == "eval":
        problems = [p for op in ops for p in pools[op]]
        rng.shuffle(problems)
        return [_row(*p, split) for p in problems[:n]]
    live = [op for op in ops if pools[op]]
    rows = []
    for _ in range(n):
        op = live[rng.randrange(len(live))]
        rows.append(_row(*pools[op][rng.randrange(len(pools[op]))], split))
    return rows


def write_arith_jsonl(path: str, split: str, n: int | None = None, *, seed: int = DEFAULT_SEED,
                      difficulty: str | Sequence[str] = "default") -> str:
    """Write ``generate_arith(split, n, seed, difficulty)`` as jsonl (atomically); returns the path."""
    rows = generate_arith(split, n, seed, difficulty)
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    storage.write_text_atomic(path, text)
    return str(path)
