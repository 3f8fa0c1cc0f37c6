"""Multi-node Ray on this host: a head with no CPUs and two worker nodes of one CPU each
(`ray.cluster_utils.Cluster`), so the trainer and the engine land on different nodes; storage on the
suite's S3 server (tests/test_s3.py). Three failures in two runs, each ending bitwise-equal to the session's
reference run:

- in one run, the node with the trainer removed mid-chunk (a replacement node joins), then the node with
  the engine mid-rollout: each time the chunk's retry rebuilds the actors from `checkpoints/latest`;
- the whole cluster lost: the run ends in one `error:` line (exit 3) with the lease released and no
  process of it left; a new cluster is started and `grpoflow resume --set cluster.address=NEW` finishes.

The moment of each failure is an event (runtime/testing/moments.py, GRPOFLOW_TEST_PAUSE_AT): the
process at that point writes a marker and waits until the test, having removed the node, lets it go.
Runs are forked from one warm process (tests/cli_zygote.py); the cluster-loss run is a plain
subprocess with its own Prefect server, so that "no orphan" covers that server too.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.waiting import wait_reached

from runtime.run import checkpoint
from runtime.run.directory import RunDir
from tests.conftest import REFERENCE_OVERRIDES
from tests.test_kill_anywhere import Zygote
from tests.test_resume import assert_same_checkpoint, checkpoint_tensors, reference_final  # noqa: F401
from tests.test_s3 import BUCKET, s3  # noqa: F401

pytestmark = pytest.mark.multinode
RUN = "mn"


class RayNodes:
    """A Ray cluster of separate node processes on this host; `env` is what every node's processes see."""

    def __init__(self, env: dict[str, str] | None = None):
        import tempfile

        from ray.cluster_utils import Cluster
        # Ray's socket paths must stay under 108 bytes: a short temp dir, not pytest's. RAY_TMPDIR keeps
        # its "current cluster" file in there too, not in /tmp/ray where any ray.init() on this host would find it.
        self._tmp = tempfile.mkdtemp(prefix="rn-")
        os.makedirs(os.path.join(self._tmp, "ray"))
        # The nodes take this host's address, not 127.0.0.1: a driver given 127.0.0.1:PORT connects to the
        # host's address (Ray's canonicalize_bootstrap_address), where a loopback-bound GCS does not answer.
        self._args = {"object_store_memory": 80 * 2**20,
                      "include_dashboard": False, "temp_dir": self._tmp}
        self.env = {**(env or {}), "RAY_TMPDIR": self._tmp}
        with self._environment():
            self.cluster = Cluster(initialize_head=True, head_node_args={**self._args, "num_cpus": 0})
            for _ in range(2):
                self._add()

    @contextlib.contextmanager
    def _environment(self):
        """What every node's processes see (the pause switch): set while nodes start, then restored."""
        old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    @property
    def address(self) -> str:
        return self.cluster.address

    def _add(self):
        node = self.cluster.add_node(**self._args, num_cpus=1)
        self.cluster.wait_for_nodes()
        return node

    def replace(self, node_id: str) -> None:
        """Remove the node with this id (no graceful shutdown: a machine dying) and add a fresh one."""
        victim = next(n for n in self.cluster.worker_nodes if n.node_id == node_id)
        self.cluster.remove_node(victim, allow_graceful=False)
        with self._environment():
            self._add()

    def shutdown(self) -> None:
        import shutil
        self.cluster.shutdown()
        shutil.rmtree(self._tmp, ignore_errors=True)


def _argv(root: str, state_dir: Path, address: str) -> list[str]:
    sets = REFERENCE_OVERRIDES + [f"storage.root={root}", f"storage.state_dir={state_dir}", "cluster.backend=ray",
                                  f"cluster.address={address}"]
    return ["run", "configs/tiny.yaml", "--run-id", RUN, *sum((["--set", s] for s in sets), [])]


@pytest.fixture(scope="module")
def zygote(s3, prefect_harness):
    import prefect.settings
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PREFECT_API_URL=prefect.settings.PREFECT_API_URL.value())
    z = Zygote(env)
    yield z
    z.close()


def _final_tensors(root: str, state_dir: Path, tmp: Path):
    final = checkpoint.latest(RunDir(root, RUN, str(state_dir)))
    assert final is not None and final.rollout == 4
    return checkpoint_tensors(final.path, tmp)


def test_trainer_node_then_engine_node_removed_mid_chunk_then_bitwise_equal(s3, zygote, reference_final, tmp_path):
    """One run, two node deaths, each time a fresh node joins: the trainer's node while rollout 0 trains, then, in the
    second chunk, the engine's node while it samples (its process's fourth generate call: the engine outlives the
    first chunk's retry, which samples rollout 0 again). The second chunk's retry restarts from rollout 2's
    checkpoint on S3; two deaths in one chunk would spend its retries."""
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    moments = ("train-step-done#1", "generate#4")
    nodes = RayNodes(env={"GRPOFLOW_TEST_PAUSE_AT": ",".join(moments), "GRPOFLOW_TEST_PAUSE_DIR": str(pauses)})
    root = f"s3://{BUCKET}/multinode-nodes"
    try:
        zygote.start(_argv(root, tmp_path / "state", nodes.address), {}, tmp_path / "run.log")
        for moment in moments:
            reached = wait_reached(pauses / f"{moment}.reached")
            assert reached["node_id"], reached  # inside a Ray actor on a worker node
            nodes.replace(reached["node_id"])  # the node with the paused actor dies; a new one joins
            (pauses / f"{moment}.go").touch()
        ended = zygote.wait()
        assert ended.get("exit") == 0, (ended, (tmp_path / "run.log").read_text()[-4000:])
    finally:
        nodes.shutdown()
    assert_same_checkpoint(_final_tensors(root, tmp_path / "state", tmp_path), reference_final)


def test_whole_cluster_lost_then_resumed_on_a_new_cluster(s3, zygote, reference_final, tmp_path):
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    root, state = f"s3://{BUCKET}/multinode-lost", tmp_path / "state"
    nodes = RayNodes()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_URL")}
    env.update(PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GRPOFLOW_TEST_PAUSE_AT="checkpoint-latest-moved#1", GRPOFLOW_TEST_PAUSE_DIR=str(pauses),
               GRPOFLOW_CLUSTER_LOST_AFTER_S="5")
    err_log = tmp_path / "stderr.log"
    # A process of its own, with its own (ephemeral) Prefect server: nothing of it may outlive it.
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", *_argv(root, state, nodes.address)[0:]],
                            stdout=(tmp_path / "stdout.log").open("w"), stderr=err_log.open("w"), env=env,
                            start_new_session=True)
    try:
        wait_reached(pauses / "checkpoint-latest-moved#1.reached", proc)
        nodes.shutdown()  # every node, the head included: the cluster is gone
        (pauses / "checkpoint-latest-moved#1.go").touch()
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = err_log.read_text().strip().splitlines()
    errors = [line for line in err if line.startswith("error:")]
    assert code == 3, err[-20:]
    assert len(errors) == 1 and err[-1] == errors[0] and "lost the Ray cluster" in errors[0], err[-20:]
    assert f"grpoflow resume {RUN} --root {root}" in errors[0]
    left = [p.info for p in psutil.process_iter(["pid", "cmdline", "status"])
            if _session_of(p.pid) == proc.pid and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert not left, left  # no Prefect server, no worker of it left running (an exited one awaiting its reaper is gone)
    rd = RunDir(root, RUN, str(state))
    from runtime import storage
    assert not storage.exists(rd.sub("lease.json"))
    assert checkpoint.latest(rd).rollout == 2

    fresh = RayNodes()
    try:
        ended = zygote.run(["resume", RUN, "--root", root, "--set", f"cluster.address={fresh.address}"], {},
                           tmp_path / "resume.log")
        assert ended.get("exit") == 0, (ended, (tmp_path / "resume.log").read_text()[-4000:])
    finally:
        fresh.shutdown()
    assert_same_checkpoint(_final_tensors(root, state, tmp_path), reference_final)


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None
