"""What `grpoflow run` needs on the GPU machine beyond its image, as one carry (issue 34).

The GPU machine (bench/README.md) has torch, transformers and most scientific packages but no Ray, Prefect,
MLflow, pydantic, math-verify or megatron-core, and no network. This script resolves those for the
machine's Python (3.12, manylinux x86-64) against the public index, keeps what its image lacks
(bench/gpu_image_packages.txt: the image's package list, 2026-11-17; no s3fs: runs there keep storage local), unpacks the wheels and packs them in
two xz tarballs under `.carry/`: Ray alone (its wheel is 79 MB, over one call's 64 MiB; unpacked without
its Java jars and RLlib and xz-compressed it is ~27 MB) and everything else (~24 MB). With the repository
(~3 MB) that is ~55 MB: one call carries all of it.

    python3 bench/gpu_carry.py prepare                 # here, with the package index reachable (~3 min)
    # on the GPU machine, in the call's command, with `.carry` in `carry`:
    python3 bench/gpu_carry.py install && export PYTHONPATH=/tmp/site:$PYTHONPATH

`install` uses only the standard library (tarfile), unpacks into /tmp/site (~10 s) and imports what it
carried once, so a missing piece fails there, not minutes into a run. The machine keeps /tmp while it stays
warm (30 s between calls): a later call on the same machine may skip `install`.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".carry"
SITE = Path("/tmp/site")
IMAGE_PACKAGES = Path(__file__).with_name("gpu_image_packages.txt")
# What `grpoflow run` imports that the image lacks (their dependencies are resolved, not listed)
TOP_LEVEL = ["ray", "prefect", "mlflow-skinny", "sqlalchemy", "alembic", "fastapi", "pydantic", "math-verify",
             "megatron-core"]
# Never carried: the image's CUDA stack is the one its torch was built with (Prefect's server imports asyncpg even on SQLite)
NEVER = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
RAY_DROP = ("ray/jars", "ray/rllib")  # Java workers and RLlib: unused, 41 MB unpacked
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
            *[a for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                            "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
              for a in ("--platform", tag)]]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_versions() -> list[str]:
    """The project's CPU pins (constraints-cpu.txt) for everything but torch: one resolution for both machines."""
    lines = (ROOT / "constraints-cpu.txt").read_text().splitlines()
    return [ln for ln in lines if ln.strip() and not ln.startswith("#") and canonical(ln.split("==")[0]) not in ("torch", "triton")]


def pip(*args: str) -> None:
    # isolated from this machine's pip configuration (extra local indexes, a global constraint file)
    subprocess.run([sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args], check=True)


def resolve(tmp: Path) -> list[tuple[str, str]]:
    """(name, version) of everything the top-level packages need on the GPU machine's Python."""
    cons = tmp / "constraints.txt"
    cons.write_text("\n".join(pinned_versions()) + "\n")
    report = tmp / "report.json"
    pip("install", "-q", "--dry-run", "--ignore-installed", "--target", str(tmp / "never"), *PLATFORM,
        "-c", str(cons), "--report", str(report), *TOP_LEVEL)
    return [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]


def to_carry(resolved: list[tuple[str, str]]) -> list[tuple[str, str]]:
    image = {canonical(ln) for ln in IMAGE_PACKAGES.read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    return [(n, v) for n, v in resolved if canonical(n) not in image and not NEVER.match(canonical(n))]


def unpack(wheels: list[Path], into: Path, drop: tuple[str, ...] = ()) -> None:
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            for info in z.infolist():
                if any(info.filename.startswith(d + "/") for d in drop):
                    continue
                path = Path(z.extract(info, into))
                mode = info.external_attr >> 16
                if mode & 0o111:  # Ray's binaries (raylet, gcs_server) must stay executable
                    path.chmod(mode & 0o777)


def pack(src: Path, dest: Path) -> int:
    import lzma
    with lzma.open(dest, "wb", preset=9 | lzma.PRESET_EXTREME) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for child in sorted(src.iterdir()):
            tar.add(child, arcname=child.name)
    return dest.stat().st_size


def prepare(_args) -> int:
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        carry = to_carry(resolve(tmp))
        wheels = tmp / "wheels"
        pip("download", "-q", "--no-deps", *PLATFORM, "-d", str(wheels), *[f"{n}=={v}" for n, v in carry])
        ray = [w for w in wheels.glob("*.whl") if canonical(w.name.split("-")[0]) == "ray"]
        rest = [w for w in wheels.glob("*.whl") if w not in ray]
        shutil.rmtree(CARRY, ignore_errors=True)
        CARRY.mkdir()
        sizes = {}
        for name, group, drop in (("ray", ray, RAY_DROP), ("site", rest, ())):
            staged = tmp / f"staged-{name}"
            unpack(group, staged, drop)
            sizes[name] = pack(staged, CARRY / f"{name}.tar.xz")
        (CARRY / "manifest.json").write_text(json.dumps({"packages": dict(carry), "bytes": sizes}, indent=1))
    total = sum(sizes.values()) / 2**20
    print(f"{len(carry)} packages in {CARRY}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items())
          + f"; {total:.1f} MiB, and the repository's ~3 MiB: " + ("one call" if total + 3 < 64 else
                                                                    "over one call's 64 MiB: install in two calls"))
    return 0


def install(args) -> int:
    site = Path(args.site)
    site.mkdir(parents=True, exist_ok=True)
    for archive in sorted(Path(args.carry).glob("*.tar.xz")):
        with tarfile.open(archive) as tar:
            tar.extractall(site, filter="fully_trusted")
    check = "import ray, prefect, mlflow, pydantic, math_verify, megatron.core, sqlalchemy, alembic; print('carried imports ok')"
    return subprocess.run([sys.executable, "-c", check], env={**os.environ, "PYTHONPATH": str(site)}).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="resolve, download and pack into .carry/ (here, with the package index)")
    ins = sub.add_parser("install", help="unpack .carry/ into /tmp/site (on the GPU machine)")
    ins.add_argument("--carry", default=str(CARRY))
    ins.add_argument("--site", default=str(SITE))
    a = ap.parse_args(argv)
    return prepare(a) if a.cmd == "prepare" else install(a)


if __name__ == "__main__":
    sys.exit(main())
