"""The SGLang rollout backend: SGLang servers launched, fed and supervised over SGLang's HTTP API.

Status: for SGLang >=0.5.17,<0.6. Tested in CI against `tests/sglang_standin.py`, a stdlib HTTP server that speaks
the endpoints and payloads read from SGLang 0.5.23's source (http_protocol.py names the files), or 0.5.17's
differences with `--sglang-version 0.5.17`; run against a real SGLang 0.5.17 server on an H200
(bench/sglang_real.py; docs/sglang.md says what was checked). docs/sglang.md is the user's guide.

By concern:
  settings.py        the `rollout.sglang` section and what the rest of the config decides for it
  http_protocol.py   request bodies, response parsing, errors, keyed sampling seeds
  server_process.py  one server's process: command line, launch, start-up wait, termination
  engine_pool.py     the servers as a pool: request slots, fan-out, memory, fault checks and restarts
  weight_sync.py     new weights into every server (disk, tensor, broadcast) and the probe check
  partial.py         partial rollout: continuing carried samples, aborting once enough groups are complete
  routes.py          routing replay (R3): each token's experts asked of the servers, decoded as the built-in engine's
  engine.py          SGLangEngine, the RolloutEngine over all of it
"""

from runtime.rollout.sglang.engine import SGLangEngine
from runtime.rollout.sglang.http_protocol import SGLangError
from runtime.rollout.sglang.settings import INSTALL_HINT, SGLangSettings, Supervision

__all__ = ["INSTALL_HINT", "SGLangEngine", "SGLangError", "SGLangSettings", "Supervision"]
