"""The pause moment where two processes reach it together, as colocated engines do (runtime/testing/moments.py)."""
from __future__ import annotations

import json
import threading

from tests.waiting import wait_reached


def test_two_reaching_one_pause_together_both_wait_and_the_first_to_publish_is_reported(tmp_path, monkeypatch):
    """Both write their record before either publishes it (a barrier, not a sleep): the interleaving in which, on
    2 x H100, the second engine's publish found its temp file already moved and the run failed."""
    from runtime.testing import moments
    monkeypatch.setenv("GRPOFLOW_TEST_PAUSE_DIR", str(tmp_path))
    both_written = threading.Barrier(2, timeout=60)
    plain_dump = json.dump

    def dump_then_meet(obj, f, **kw):
        plain_dump(obj, f, **kw)
        f.flush()
        both_written.wait()
    monkeypatch.setattr(json, "dump", dump_then_meet)
    errors: list[BaseException] = []

    def engine():
        try:
            moments._pause("decode-chunk-8#1")  # each thread stands for an engine process
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)
    threads = [threading.Thread(target=engine) for _ in range(2)]
    for t in threads:
        t.start()
    record = wait_reached(tmp_path / "decode-chunk-8#1.reached", timeout_s=60)
    (tmp_path / "decode-chunk-8#1.go").touch()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and errors == []
    assert record["pid"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode-chunk-8#1.go", "decode-chunk-8#1.reached"]
