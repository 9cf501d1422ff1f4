"""Download, here, the wheels `cuda_check.py` needs beyond the GPU image, for that image's Python.

    python benchmarks/cuda_wheels.py [--dest .whl] [--python-version 3.12|this]

The lent GPU machine (an H200 image: Python 3.12, PyTorch, Triton, numpy, pluggy, tqdm,
tokenizers, safetensors, transformers, pytest; no network) lacks pydantic and its three
dependencies and gguf. This fetches them from the package index into `--dest` (ignored by
git; a few MB), at the versions installed in this environment (the ones the suite tested),
as manylinux x86-64 wheels for `--python-version` ("this": the running interpreter, to try
the install-from-folder path here). `cuda_check.py` installs the folder with
`pip --no-index --no-deps --target` before it imports polyrunner. Wheels of other versions of
the same packages are removed from `--dest` (two versions of one package stop pip). Carry the
folder to the GPU machine with the run (`carry: [".whl"]`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "gguf")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
GPU_IMAGE_PYTHON = "3.12"


def normalised(name: str) -> str:
    """A distribution name as wheel file names spell it (PEP 503 + underscores)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def pins() -> list[str]:
    """`name==version` for each of `PACKAGES`, at this environment's versions (ValueError if one is absent)."""
    out = []
    for name in PACKAGES:
        try:
            out.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            raise ValueError(f"{name} is not installed here: install polyrunner's dependencies first "
                             "(make setup), so the wheels match what the suite tests") from None
    return out


def download(dest: Path, python_version: str) -> list[Path]:
    """The wheels of `pins()` for `python_version` in `dest` (stale versions removed); raises on failure."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = pins()
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest),
           *[arg for p in PLATFORMS for arg in ("--platform", p)], *wanted]
    subprocess.run(cmd, check=True)
    keep = {normalised(p.split("==")[0]): p.split("==")[1] for p in wanted}
    for wheel in dest.glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        if normalised(name) in keep and version != keep[normalised(name)]:
            wheel.unlink()
    return sorted(w for w in dest.glob("*.whl") if normalised(w.name.split("-")[0]) in keep)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".whl", help="folder for the wheels (default .whl)")
    ap.add_argument("--python-version", default=GPU_IMAGE_PYTHON,
                    help=f"the target interpreter (default {GPU_IMAGE_PYTHON}, the GPU image's; 'this': this one)")
    args = ap.parse_args()
    version = args.python_version
    if version == "this":
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheels = download(args.dest, version)
    size = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"{len(wheels)} wheels for Python {version}, {size / 2**20:.2f} MiB in {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
