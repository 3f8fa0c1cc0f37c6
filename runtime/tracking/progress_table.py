"""What users watch while a run runs: one line per stage as it ends, then the per-rollout table: progress
against the total (rollout i/N, elapsed, ETA), then loss, reward, kl, lengths, speeds."""
from __future__ import annotations

import time
from typing import Callable

from rich.console import Console

from runtime.run.run_log import terminal_out

COLUMNS = [("loss", "loss", "{:+.4f}"), ("reward", "reward_mean", "{:.3f}"),
           ("r_std", "reward_std", "{:.3f}"), ("kl", "kl", "{:.4f}"), ("entropy", "entropy", "{:.3f}"),
           ("clip", "clip_frac", "{:.3f}"), ("gnorm", "grad_norm", "{:.3f}"), ("len", "response_len_mean", "{:.1f}"),
           ("len_max", "response_len_max", "{:d}"), ("trunc", "truncated_frac", "{:.2f}"),
           ("roll tok/s", "rollout_tok_s", "{:.0f}"), ("train tok/s", "train_tok_s", "{:.0f}"),
           ("step s", "step_time_s", "{:.2f}")]
# shown when the first row has them: a mixture of experts' router losses (unscaled, mean over layers)
OPTIONAL_COLUMNS = [("aux", "router_aux_loss", "{:.4f}"), ("z_loss", "router_z_loss", "{:.4f}")]
PROGRESS = ["rollout", "elapsed", "eta"]


def _fmt(fmt: str, v) -> str:
    if v is None:
        return "-"
    try:
        return fmt.format(int(v) if fmt.endswith("d}") else v)
    except (TypeError, ValueError):
        return str(v)


def stage_line(stage: str, result: dict) -> None:
    """``fetch         done in 4.48 s`` (or ``skipped (done before)``), aligned with the plan's lines."""
    status = "skipped (done before)" if result.get("skipped") else f"done in {result.get('seconds', 0)} s"
    out = terminal_out()
    print(f"{stage:<14}{status}", file=out)
    out.flush()


def clock(seconds: float) -> str:
    """``75.4`` -> ``1:15``; ``3725`` -> ``1:02:05``."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class RolloutTable:
    """Prints a header once, then one aligned row per rollout as it finishes.

    The first column counts rollouts done (rollout id + 1). ``total``: the run's ``train.num_rollout``;
    the column then reads ``i/N`` and the ETA is the remaining rollouts at the pace of those run by this table (so it
    includes the checkpoints and evals between them, and ignores chunks a resumed run skipped).
    """

    def __init__(self, console: Console | None = None, total: int | None = None,
                 now: Callable[[], float] = time.monotonic):
        # the terminal even while the run's log holds stdout (runtime/run/run_log.py)
        self.console = console or Console(file=terminal_out(), highlight=False)
        self.total, self._now = total, now
        self._t0 = now()
        self._rows = 0
        digits = len(str(total)) if total else 4
        self.columns = list(COLUMNS)
        self.widths = [max(2 * digits + 1, len("rollout")), 7, 7] + [max(len(h), 8) for h, _, _ in COLUMNS]
        self._header = False

    def progress(self, m: dict) -> list[str]:
        """The row's first cells: rollout i/N, elapsed, ETA ('-' without a total)."""
        self._rows += 1
        elapsed = self._now() - self._t0
        done = int(m["rollout"]) + 1 if m.get("rollout") is not None else None
        if self.total is None or done is None:
            return [_fmt("{:d}", done), clock(elapsed), "-"]
        eta = max(self.total - done, 0) * elapsed / self._rows
        return [f"{done}/{self.total}", clock(elapsed), clock(eta)]

    def row(self, m: dict) -> None:
        if not self._header:
            extra = [c for c in OPTIONAL_COLUMNS if m.get(c[1]) is not None]
            self.columns += extra
            self.widths += [max(len(h), 8) for h, _, _ in extra]
            heads = PROGRESS + [h for h, _, _ in self.columns]
            self.console.print("  ".join(h.rjust(w) for h, w in zip(heads, self.widths)), style="bold", soft_wrap=True)
            self._header = True
        cells = self.progress(m) + [_fmt(f, m.get(k)) for _, k, f in self.columns]
        # one line per rollout however narrow the terminal or log (a row is ~170 characters)
        self.console.print("  ".join(c.rjust(w) for c, w in zip(cells, self.widths)), soft_wrap=True)
