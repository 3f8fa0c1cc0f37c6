"""A TrainSession over a run directory whose stages ran: what the tests that drive the loop directly start from."""
from __future__ import annotations


def prepared_session(cfg, rd):
    """fetch, convert and prepare for ``cfg`` into ``rd`` (the product's stages), then the run's TrainSession."""
    from runtime.grpo.session import TrainSession
    from runtime.run import stages
    fetched = stages.fetch(cfg, rd)
    stages.convert(cfg, rd, fetched)
    stages.prepare(cfg, rd, fetched)
    return TrainSession(cfg, rd)
