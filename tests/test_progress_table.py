"""The live table shows progress against the total: rollout i/N, elapsed, and an ETA at the pace so far."""
from __future__ import annotations

import io

from rich.console import Console

from runtime.tracking.progress_table import RolloutTable, clock


def test_rows_show_i_of_n_elapsed_and_eta():
    now = [100.0]
    buf = io.StringIO()
    table = RolloutTable(Console(file=buf, width=400, highlight=False), total=10, now=lambda: now[0])
    for rollout, t in ((4, 130.0), (5, 160.0)):  # a resumed run: rollouts 0-3 were done before
        now[0] = t
        table.row({"rollout": rollout, "reward_mean": 0.25})
    head, first, second = buf.getvalue().splitlines()
    assert head.split()[:3] == ["rollout", "elapsed", "eta"]
    # 5/10 after 30 s at 30 s a rollout: 5 left -> 2:30; 6/10 after 60 s: 4 left at 30 s -> 2:00
    assert first.split()[:4] == ["5/10", "0:30", "2:30", "-"] and second.split()[:3] == ["6/10", "1:00", "2:00"]
    assert "0.250" in second


def test_without_a_total_the_count_stands_alone():
    buf = io.StringIO()
    RolloutTable(Console(file=buf, width=400), now=lambda: 0.0).row({"rollout": 0})
    assert buf.getvalue().splitlines()[1].split()[:3] == ["1", "0:00", "-"]


def test_clock():
    assert (clock(0), clock(75.4), clock(3725)) == ("0:00", "1:15", "1:02:05")
