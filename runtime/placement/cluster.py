"""Where the trainer ranks and the rollout engine live: in this process, or as Ray actors.

Ray is the launcher, not the design: both backends hand back typed handles
(runtime/placement/handles.py) over an actor group (runtime/placement/groups.py).
"""
from __future__ import annotations

import os
from typing import Any

from runtime.placement import layout
from runtime.config import GrpoConfig
from runtime.devices import make_current, resolve_device, resolve_dtype
from runtime.errors import ConfigError, TransientError
from runtime.placement.cluster_watch import ClusterWatch, check_reachable
from runtime.placement.groups import LocalGroup, RayGroup
from runtime.rollout.base import RolloutEngine
from runtime.placement.handles import EngineHandle, TrainerHandle
from runtime.placement.ports import free_port
from runtime.placement.subprocess_group import SubprocessGroup


class Cluster:
    """One connection to wherever the actors run, held for a whole train stage.

    Placement (`runtime.placement.layout`): trainer rank r on GPU r; built-in engine i (one per rollout GPU)
    on GPU i when colocated, else on the i-th GPU after the trainer's. Under `cluster.backend: local` the
    trainer runs in this process when it is one rank sharing the engine's device, else one spawned process
    per rank; one engine runs in this process, several in one spawned process each.
    """

    def __init__(self, cfg: GrpoConfig, hf_config=None):
        self.cfg = cfg
        self.backend = cfg.cluster.backend
        self.device = resolve_device(cfg)
        self.dtype = resolve_dtype(cfg, self.device)
        self._pg = None
        self._watch = None
        self._ray_started_here = False
        self.weight_sync = layout.weight_sync_mode(cfg)
        gpus = None
        if self.backend == "local" and self.device == "cuda":
            import torch
            gpus = torch.cuda.device_count()
        layout.check_layout(cfg, hf_config=hf_config, gpus_available=gpus)

    @property
    def trainer_in_subprocesses(self) -> bool:
        return layout.trainer_in_subprocesses(self.cfg)

    @property
    def engine_device(self) -> str:
        return self.engine_devices[0]

    @property
    def engine_devices(self) -> list[str]:
        """The device of every engine actor."""
        n = layout.rollout_engines(self.cfg)
        if self.device != "cuda" or self.backend == "ray":  # Ray sets each actor's visible GPU
            return [self.device] * n
        return [f"cuda:{g}" for g in layout.engine_gpus(self.cfg)]

    @property
    def direct_transport(self) -> str:
        return layout.direct_transport(self.cfg, self.device)

    @property
    def _engine_shares_gpu(self) -> bool:
        """Ray, colocated on GPUs: engine i joins trainer rank i's bundle and its GPU, half each."""
        c = self.cfg.cluster
        return self.backend == "ray" and c.colocate and c.trainer_gpus > 0

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> "Cluster":
        if self.backend != "ray":
            return self
        import ray
        if not ray.is_initialized():
            c = self.cfg.cluster
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True,
                                  "ignore_reinit_error": True}
            if c.address:
                check_reachable(c.address)  # Ray itself would retry for minutes
                kw["address"] = c.address
            else:
                # Logical CPUs: a placement group counts bundles, not cores, so DP ranks plus an
                # engine fit on a 2-core machine.
                kw["num_cpus"] = c.num_cpus or max(os.cpu_count() or 1, layout.trainer_world_size(self.cfg) + 1)
                kw["_node_ip_address"] = "127.0.0.1"
                if os.environ.get("GRPOFLOW_RAY_TEMP_DIR"):
                    kw["_temp_dir"] = os.environ["GRPOFLOW_RAY_TEMP_DIR"]
                if os.environ.get("GRPOFLOW_RAY_OBJECT_STORE_MB"):
                    kw["object_store_memory"] = int(os.environ["GRPOFLOW_RAY_OBJECT_STORE_MB"]) * 2**20
            try:
                ray.init(**kw)
            except (ConnectionError, TimeoutError):
                raise
            except Exception as err:  # noqa: BLE001 - Ray says "timed out during startup" as a bare Exception
                first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
                where = f"connect to the Ray cluster at {c.address}" if c.address else "start a local Ray cluster"
                raise TransientError(f"could not {where}: {first}") from err
            self._ray_started_here = True
        self._watch = ClusterWatch.of_current_cluster()  # the whole cluster lost: one line, lease released
        layout.check_gpus(self.cfg, int(ray.cluster_resources().get("GPU", 0)), where="the Ray cluster")
        self._place()
        return self

    def _place(self) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        c = self.cfg.cluster
        n = layout.trainer_world_size(self.cfg)
        trainer_bundle = {"CPU": 1, **({"GPU": 1} if c.trainer_gpus else {})}
        engine_bundle = {"CPU": 1, **({"GPU": 1} if c.rollout_gpus and not c.colocate else {})}
        bundles = [trainer_bundle] * n + ([] if self._engine_shares_gpu else [engine_bundle] * layout.rollout_engines(self.cfg))
        pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=c.placement_timeout_s)
        except Exception:  # GetTimeoutError
            remove_placement_group(pg)
            avail = ray.available_resources()
            raise ConfigError(
                f"the Ray cluster cannot place {len(bundles)} bundles {bundles} within "
                f"cluster.placement_timeout_s={c.placement_timeout_s:g} s (available: "
                f"{ {k: v for k, v in avail.items() if k in ('CPU', 'GPU')} }); lower train.data_parallel / "
                f"tensor_parallel or cluster.*_gpus, or add nodes") from None
        self._pg = pg

    def shutdown(self) -> None:
        if self.backend != "ray":
            return
        import ray
        if self._watch is not None:
            self._watch.stop()
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group
            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None
        if self._ray_started_here and ray.is_initialized():
            ray.shutdown()

    # -- actors --------------------------------------------------------------------------------
    def _threads(self) -> int:
        engines = 0 if self.cfg.cluster.colocate else layout.rollout_engines(self.cfg)
        return max(1, (os.cpu_count() or 1) // (layout.trainer_world_size(self.cfg) + engines))

    def trainer(self, in_subprocesses: bool | None = None, **trainer_kwargs) -> TrainerHandle:
        """The trainer ranks, built with `trainer_kwargs` (MegatronTrainer's). in_subprocesses (local
        backend): None decides by the layout; True forces one process per rank."""
        from runtime.trainer.megatron_trainer import MegatronTrainer
        n = layout.trainer_world_size(self.cfg)
        common = dict(trainer_kwargs, world_size=n, device=self.device, dtype=self.dtype)
        own = self.trainer_in_subprocesses if in_subprocesses is None else (in_subprocesses or n > 1)
        if self.backend == "local" and not own:
            return TrainerHandle(LocalGroup([MegatronTrainer(rank=0, master_port=free_port(), **common)]))
        port = free_port()
        if self.backend == "local":
            return TrainerHandle(SubprocessGroup(
                "runtime.trainer.megatron_trainer:MegatronTrainer",
                [dict(common, rank=r, master_port=port, num_threads=self._threads()) for r in range(n)],
                [{"LOCAL_RANK": str(r)} for r in range(n)]))
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        gpus = (0.5 if self._engine_shares_gpu else 1) if self.cfg.cluster.trainer_gpus else 0
        cls = ray.remote(num_cpus=1, num_gpus=gpus, max_restarts=0)(MegatronTrainer)
        actors = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self._pg, placement_group_bundle_index=r)).remote(
                rank=r, master_addr="127.0.0.1" if not self.cfg.cluster.address else _node_ip(),
                master_port=port, num_threads=self._threads(), **common) for r in range(n)]
        handle = TrainerHandle(RayGroup(actors))
        handle.ping()  # surface construction errors here, not at the first rollout
        return handle

    def engine(self, model_dir: str, shared_base: dict | None = None) -> EngineHandle:
        """The rollout engine(s): one, or one built-in engine per rollout GPU behind one handle. shared_base
        (`layout.shares_base`): the in-process trainer's base tensors, which the one engine decodes with. With
        ``rollout.expert_shards`` > 1 consecutive engines make one replica, each holding a shard of the experts."""
        from runtime.rollout.factory import make_engine
        devices = self.engine_devices
        kwargs = dict(cfg=self.cfg, model_dir=model_dir, dtype=self.dtype)
        shards = self._shard_specs(len(devices))
        if self.backend == "local" and len(devices) == 1:
            make_current(devices[0])
            return EngineHandle(LocalGroup([make_engine(device=devices[0], shared_base=shared_base, **kwargs)]))
        if shared_base is not None:
            raise ValueError("a shared base goes to one engine in this process only")
        if self.backend == "local":  # one process per engine, each on its GPU (they generate at once)
            threads = max(1, (os.cpu_count() or 1) // len(devices)) if self.device != "cuda" else self._threads()
            handle = EngineHandle(SubprocessGroup("runtime.placement.cluster:_EngineHost",
                                                  [dict(kwargs, device=d, num_threads=threads, expert_shard=shard)
                                                   for d, shard in zip(devices, shards)]),
                                  expert_shards=self.cfg.rollout.expert_shards)
            handle.health()
            return handle
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        shared = self._engine_shares_gpu
        gpus = 0.5 if shared else (1 if self.cfg.cluster.rollout_gpus and not self.cfg.cluster.colocate else 0)
        cls = ray.remote(num_cpus=0 if shared else 1, num_gpus=gpus, max_restarts=0)(_EngineHost)
        first = 0 if shared else layout.trainer_world_size(self.cfg)
        actors = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self._pg, placement_group_bundle_index=first + i)).remote(
                num_threads=self._threads(), device=device, expert_shard=shard, **kwargs)
            for i, (device, shard) in enumerate(zip(devices, shards))]
        handle = EngineHandle(RayGroup(actors), expert_shards=self.cfg.rollout.expert_shards)
        handle.health()  # surface construction errors here
        return handle

    def _shard_specs(self, engines: int) -> list:
        """Each engine's `ShardSpec` (None each without ``rollout.expert_shards``): engine i is shard i % n of replica
        i // n, whose first engine hosts the replica's rendezvous (on this node, as the trainer's)."""
        n = self.cfg.rollout.expert_shards
        if n == 1:
            return [None] * engines
        from runtime.rollout.expert_shards import ShardSpec
        host = "127.0.0.1" if self.backend == "local" or not self.cfg.cluster.address else _node_ip()
        ports = [free_port() for _ in range(engines // n)]  # each engine process joins one group: names need not vary
        return [ShardSpec(index=i % n, count=n, host=host, port=ports[i // n], name=f"grpoflow_experts_{i // n}")
                for i in range(engines)]


class _EngineHost:
    """An actor (Ray, or a spawned process of the local backend) holding one rollout engine; forwards the
    engine interface (`_ENGINE_METHODS`)."""

    def __init__(self, num_threads: int | None = None, **kwargs):
        import torch
        if num_threads:
            torch.set_num_threads(num_threads)
        make_current(str(kwargs.get("device", "")))
        from runtime.rollout.factory import make_engine
        self.engine = make_engine(**kwargs)

    def pid(self):
        return os.getpid()


# Ray calls only methods defined on the actor's class: one forwarder per method of the engine interface.
_ENGINE_METHODS = tuple(name for name, member in vars(RolloutEngine).items()
                        if callable(member) and not name.startswith("_"))


def _forwarder(name: str):
    def forward(self, *a, **k):
        return getattr(self.engine, name)(*a, **k)
    forward.__name__ = name
    return forward


for _name in _ENGINE_METHODS:
    setattr(_EngineHost, _name, _forwarder(_name))


def _node_ip() -> str:
    import ray
    return ray.util.get_node_ip_address()
