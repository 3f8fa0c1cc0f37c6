"""What the Triton kernel tests share: the interpreter, which decides at import time, runs a test file's own
`__main__` checks in a child process; which Triton can run or compile what here."""
from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(test_file: str, timeout: float = 600) -> None:
    """`python test_file` with TRITON_INTERPRET=1 from the repository root (importable there); its failure is this
    test's."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def interpreter_reads_loop_bounds() -> bool:
    """Triton's interpreter before 3.7 holds a loaded scalar as a one-element array, which it cannot turn into a loop
    bound (a kernel's `range(lo, hi, ...)`: numpy's "only 0-dimensional arrays" error); torch 2.11 ships 3.6."""
    import triton
    return tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7)


def has_nvidia_backend() -> bool:
    """Triton can compile for sm_90 here (no GPU needed)."""
    from triton.backends import backends
    return "nvidia" in backends
