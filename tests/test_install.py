"""What `make setup` installs resolves from the public package index alone.

pip runs with this machine's configuration and every PIP_* variable ignored (`--isolated`, PIP_CONFIG_FILE
set to the null device: no extra local indexes, no find-links, no global constraint file), as a dry run that
ignores what is installed, on the Makefile's second step: `-c constraints-cpu.txt -e '.[test]'`. A pin the
public index does not serve (a local version label such as `+cpu`, or a version another pin's dependencies
exclude) is a failed test, and so is an index that cannot be reached: CI reaches PyPI.

`--use-feature=fast-deps` reads each wheel's metadata with HTTP range requests where the index does not serve
it apart (PEP 658), so no wheel is downloaded whole (torch's CUDA libraries are gigabytes).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO / "constraints-cpu.txt"


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_constraints_pin_only_public_versions():
    labelled = {name: v for name, v in _pins().items() if "+" in v or not v}
    assert not labelled, f"constraints-cpu.txt: pin public versions (name==X.Y.Z, no local label): {labelled}"


def test_the_install_resolves_from_the_public_index_alone(tmp_path):
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no configuration file at all, the global one included
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed", "--quiet",
         "--disable-pip-version-check", "--use-feature=fast-deps", "--report", str(report),
         "-c", str(CONSTRAINTS), "-e", f"{REPO}[test]"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the install does not resolve from the public index:\n{proc.stderr[-3000:]}"
    picked = {re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower(): item["metadata"]["version"]
              for item in json.loads(report.read_text())["install"]}
    pins = _pins()
    assert picked["torch"] == pins["torch"], picked["torch"]
    assert {n: picked[n] for n in pins if n in picked} == {n: v for n, v in pins.items() if n in picked}
