"""SGLang 0.5.17 for the GPU machine, as a carry (issue 58).

SGLang 0.5.17 is the last release that pins `torch==2.11.0`, the GPU image's own torch (2.11.0+cu130), so it can
run there beside the image's CUDA stack. The machine has no network: this script resolves SGLang's needs for the
machine's Python (3.12, manylinux x86-64) against the public index, keeps what a Hopper server of a dense model
loads with the flags grpoflow passes (below), and packs it into xz parts of at most `PART_MIB` each, since one call
carries 64 MiB and a warm machine keeps /tmp for 30 s between calls: the parts go over back-to-back calls.

    python3 bench/sglang_carry.py prepare             # here, with the package index reachable (~3 min)
    # on the GPU machine, one call per part directory (`.carry-sglang/part-N` in `carry`), each:
    python3 bench/sglang_carry.py install --part .carry-sglang/part-1 ...
    python3 bench/sglang_carry.py check                # imports the server's modules from /tmp/sglang-site
    python3 bench/sglang_carry.py save-cache --out $OUT/cache   # after a server ran: its compiled kernels, packed
    python3 bench/sglang_carry.py install-cache --from .carry-sglang/part-3/sglang-cache.tar.xz   # a later session

The server's Triton and Inductor caches (`sglang_real.SERVER_CACHES`, under /tmp/sglang-cache) are what its first
start on a fresh machine spends most of its time filling (255 s against 77 s for a restart with them warm): packed
after one session's first start and carried with part 3 into the next, they spare that compile. They are keyed by
kernel source, Triton version and GPU, so a stale entry is recompiled, not misused.

The server runs from a site of its own (`/tmp/sglang-site`), not grpoflow's: SGLang 0.5.17 wants
transformers 5.12.1 and fastapi 0.165 where the image has transformers 5.17 and grpoflow's Prefect needs
fastapi < 0.151. grpoflow reaches it through `rollout.sglang.launch`:
`["env", "PYTHONPATH=/tmp/sglang-site", "{python}", "-m", "sglang.launch_server", "--attention-backend", "triton",
"--sampling-backend", "pytorch", "--grammar-backend", "none"]`.

What is left out, and why the server does not need it:
- the image's own packages (torch, triton, torchvision, the CUDA libraries, numpy, ...): the server uses them;
- `sgl_kernel/flash_ops.abi3.so` (FlashAttention-3, 1.1 GB of the kernel wheel's 1.2 GB): only
  `sgl_kernel.flash_attn` loads it, which the `fa3` attention backend imports; grpoflow passes
  `--attention-backend triton` (with deterministic inference it keeps the radix cache, so the 8 samples of a
  prompt share its prefix; `flashinfer` would disable it);
- `sgl_kernel/sm100/*` and `flashmla_ops`: Blackwell and MLA (DeepSeek) kernels;
- FlashAttention-4, CUTLASS DSL, quack, tilelang, tokenspeed, helion, z3 (kernel DSLs of other backends and of
  MoE/MLA paths), deep_gemm's JIT headers are kept (small) but not used by a bf16 dense model;
- the CUDA toolkit wheels (nvcc, nvvm, crt, nvdisasm): the image has nvcc 13.0 for flashinfer's JIT, which
  `--sampling-backend pytorch` and the triton backend do not reach;
- modelscope, torchcodec, anthropic: another hub, video inputs, another API. (IPython and soundfile stay:
  `import sglang` and the OpenAI realtime route import them at start-up.)
"""
from __future__ import annotations

import argparse
import base64
import hashlib
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_carry import IMAGE_PACKAGES, PLATFORM, canonical, pip  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / ".carry-sglang"
SITE = Path("/tmp/sglang-site")
SGLANG = "sglang==0.5.17"
TORCH = "2.11.0"  # the GPU image's
PART_MIB = 56  # one call carries 64 MiB, the repository included
# Platform tags beyond gpu_carry's: some of SGLang's needs ship only these
MORE_PLATFORMS = [a for tag in ("manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64")
                  for a in ("--platform", tag)]
NOT_NEEDED = re.compile(r"^(torch|triton|tokenspeed-.*|nvidia-cutlass-dsl.*|nvidia-nvvm|nvidia-cuda-(nvcc|crt|nvdisasm)"
                        r"|tilelang|z3-solver|nvidia-mathdx|helion|py-spy|modelscope.*|torchcodec"
                        r"|quack-kernels|flash-attn-4|anthropic)$")
KERNEL_DROP = ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/", "sgl_kernel/flashmla_ops.abi3.so")
# The image's packages the server may use as they are, whatever version SGLang's metadata asks for, except these:
# transformers 5.12.1 (the image has 5.17) checks at import for tokenizers <= 0.23.0 (the image has 0.23.2)
SERVER_OWN = {"transformers", "tokenizers"}
CHECK = ("import sglang, sgl_kernel, sglang.srt.server_args, sglang.srt.entrypoints.http_server, "
         "sglang.srt.managers.scheduler, sglang.srt.layers.attention.triton_backend, torch_memory_saver; "
         "print('sglang', sglang.__version__, 'imports ok')")


def _stub_torch(into: Path) -> Path:
    """A wheel named torch 2.11.0+stub with no requirements: SGLang's resolution then keeps the image's torch and
    leaves out torch's CUDA wheels (one of which the index no longer serves)."""
    version = f"{TORCH}+stub"
    dist = f"torch-{version}.dist-info"
    files = {f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: sglang_carry\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    into.mkdir(parents=True, exist_ok=True)
    wheel = into / f"torch-{version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(text)}")
        z.writestr(f"{dist}/RECORD", "\n".join(record + [f"{dist}/RECORD,,"]) + "\n")
    return into


def resolve(tmp: Path) -> list[tuple[str, str]]:
    report = tmp / "report.json"
    pip("install", "-q", "--dry-run", "--ignore-installed", "--target", str(tmp / "never"), *PLATFORM, *MORE_PLATFORMS,
        "--find-links", str(_stub_torch(tmp / "stubs")), "--report", str(report), SGLANG, f"torch=={TORCH}+stub")
    return [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.loads(report.read_text())["install"]]


def to_carry(resolved: list[tuple[str, str]]) -> list[tuple[str, str]]:
    image = {canonical(ln) for ln in IMAGE_PACKAGES.read_text().splitlines() if ln.strip() and not ln.startswith("#")}
    return [(n, v) for n, v in resolved
            if not NOT_NEEDED.match(canonical(n)) and (canonical(n) not in image or canonical(n) in SERVER_OWN)]


def _unpack(wheel: Path, into: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if any(info.filename.startswith(d) for d in KERNEL_DROP):
                continue
            path = Path(z.extract(info, into))
            mode = info.external_attr >> 16
            if mode & 0o111:
                path.chmod(mode & 0o777)


def _pack_parts(site: Path, dest: Path) -> list[tuple[str, int]]:
    """Each top-level entry of `site` (the small ones together) into an xz tarball of its own, then the tarballs
    into part directories of at most PART_MIB each by their real sizes (largest first, first fit)."""
    import lzma

    def size(p: Path) -> int:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size

    entries = sorted(site.iterdir(), key=size, reverse=True)
    groups = [[p] for p in entries if size(p) >= 2**20] + [[p for p in entries if size(p) < 2**20]]
    archives = dest / "archives"
    archives.mkdir(parents=True)
    made = []
    for i, members in enumerate(g for g in groups if g):
        out = archives / f"{i:03d}-{members[0].name if len(members) == 1 else 'small'}.tar.xz"
        with lzma.open(out, "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
            for p in members:
                tar.add(p, arcname=p.name)
        made.append((out, out.stat().st_size))
    budget = PART_MIB * 2**20
    loads: list[int] = []
    for out, n in sorted(made, key=lambda m: -m[1]):
        if n > budget:
            raise SystemExit(f"{out.name} alone is {n / 2**20:.1f} MiB, over a part's {PART_MIB} MiB")
        i = next((i for i, load in enumerate(loads) if load + n <= budget), len(loads))
        if i == len(loads):
            loads.append(0)
        loads[i] += n
        part = dest / f"part-{i + 1}"
        part.mkdir(exist_ok=True)
        out.rename(part / out.name)
    archives.rmdir()
    return [(f"part-{i + 1}", load) for i, load in enumerate(loads)]


def prepare(args) -> int:
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        carry = to_carry(resolve(tmp))
        wheels = Path(args.wheels) if args.wheels else tmp / "wheels"  # pip download reuses what is there
        pip("download", "-q", "--no-deps", *PLATFORM, *MORE_PLATFORMS, "-d", str(wheels),
            *[f"{n}=={v}" for n, v in carry])
        wanted = {(canonical(n), v) for n, v in carry}
        site = tmp / "site"
        for w in sorted(wheels.glob("*.whl")):
            name, version = w.name.split("-")[:2]
            if (canonical(name), version) in wanted:
                _unpack(w, site)
                wanted.discard((canonical(name), version))
        if wanted:
            raise SystemExit(f"no wheel downloaded for {sorted(wanted)}")
        shutil.rmtree(CARRY, ignore_errors=True)
        CARRY.mkdir()
        parts = _pack_parts(site, CARRY)
    (CARRY / "manifest.json").write_text(json.dumps({"sglang": SGLANG, "packages": dict(carry),
                                                     "parts": dict(parts)}, indent=1))
    print(f"{len(carry)} packages in {len(parts)} parts: "
          + ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in parts) + "; one call per part")
    return 0


def install(args) -> int:
    site = Path(args.site)
    site.mkdir(parents=True, exist_ok=True)
    for part in args.part:
        for archive in sorted(Path(part).glob("*.tar.xz")):
            with tarfile.open(archive) as tar:
                tar.extractall(site, filter="fully_trusted")
        print(f"unpacked {part} into {site}")
    return 0


CACHE = Path("/tmp/sglang-cache")


def save_cache(args) -> int:
    """Pack the server's compile caches into OUT/sglang-cache.tar.xz (a file back from a call: <= 16 MiB)."""
    if not CACHE.is_dir():
        raise SystemExit(f"save-cache: no {CACHE} (a server launched through sglang_real.launch_prefix fills it)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "sglang-cache.tar.xz"
    with tarfile.open(target, "w:xz", preset=6) as tar:
        tar.add(CACHE, arcname=".")
    size = target.stat().st_size
    print(f"packed {CACHE} into {target}: {size / 2**20:.1f} MiB"
          + (" - over the 16 MiB a file back from a call may be" if size > 16 * 2**20 else ""))
    return 0


def install_cache(args) -> int:
    CACHE.mkdir(parents=True, exist_ok=True)
    with tarfile.open(args.source) as tar:
        tar.extractall(CACHE, filter="fully_trusted")
    print(f"unpacked {args.source} into {CACHE}")
    return 0


def check(args) -> int:
    env = {**os.environ, "PYTHONPATH": str(args.site)}
    return subprocess.run([sys.executable, "-c", CHECK], env=env).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="resolve, download and pack into .carry-sglang/ (here, with the package index)")
    prep.add_argument("--wheels", help="keep the downloaded wheels here (a later prepare reuses them)")
    ins = sub.add_parser("install", help="unpack parts into the server's site (on the GPU machine)")
    ins.add_argument("--part", nargs="+", required=True)
    ins.add_argument("--site", default=str(SITE))
    chk = sub.add_parser("check", help="import the server's modules from its site (on the GPU machine)")
    chk.add_argument("--site", default=str(SITE))
    save = sub.add_parser("save-cache", help="pack the server's compile caches (on the GPU machine, after a start)")
    save.add_argument("--out", required=True)
    inc = sub.add_parser("install-cache", help="unpack a saved cache (on the GPU machine, before a start)")
    inc.add_argument("--from", dest="source", required=True)
    a = ap.parse_args(argv)
    return {"prepare": prepare, "install": install, "check": check, "save-cache": save_cache,
            "install-cache": install_cache}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
