"""The per-rollout table users watch: loss, reward, kl, lengths, speeds."""
from __future__ import annotations

from rich.console import Console

COLUMNS = [("rollout", "rollout", "{:d}"), ("loss", "loss", "{:+.4f}"), ("reward", "reward_mean", "{:.3f}"),
           ("r_std", "reward_std", "{:.3f}"), ("kl", "kl", "{:.4f}"), ("entropy", "entropy", "{:.3f}"),
           ("clip", "clip_frac", "{:.3f}"), ("gnorm", "grad_norm", "{:.3f}"), ("len", "response_len_mean", "{:.1f}"),
           ("len_max", "response_len_max", "{:d}"), ("trunc", "truncated_frac", "{:.2f}"),
           ("roll tok/s", "rollout_tok_s", "{:.0f}"), ("train tok/s", "train_tok_s", "{:.0f}"),
           ("step s", "step_time_s", "{:.2f}")]


def _fmt(fmt: str, v) -> str:
    if v is None:
        return "-"
    try:
        return fmt.format(int(v) if fmt.endswith("d}") else v)
    except (TypeError, ValueError):
        return str(v)


class RolloutTable:
    """Prints a header once, then one aligned row per rollout as it finishes."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(highlight=False)
        self.widths = [max(len(h), 8) for h, _, _ in COLUMNS]
        self._header = False

    def row(self, m: dict) -> None:
        if not self._header:
            self.console.print("  ".join(h.rjust(w) for (h, _, _), w in zip(COLUMNS, self.widths)), style="bold")
            self._header = True
        self.console.print("  ".join(_fmt(f, m.get(k)).rjust(w) for (_, k, f), w in zip(COLUMNS, self.widths)))
