"""The CUDA image's proofs, run inside it by `make image-cuda-check` (`python - < this file`), on a machine with or
without a GPU: torch is the CUDA build, and cuDNN and NCCL, from torch's nvidia-* wheels, load. Each proof prints one
line; a failed one ends the script non-zero. benchmarks/RESULTS.md ("The CUDA image") holds the recorded output."""

from __future__ import annotations

import sys

import torch


def mapped_nvidia_libraries() -> list[str]:
    """The nvidia-* wheels' shared libraries this process has loaded (its memory map names each file)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "/nvidia/" in line and ".so" in line}
    return sorted(path.split("/site-packages/")[-1] for path in paths)


def main() -> int:
    failures = []
    print(f"torch {torch.__version__}: torch.version.cuda = {torch.version.cuda}, "
          f"GPU visible: {torch.cuda.is_available()}")
    if not torch.version.cuda:
        failures.append("torch.version.cuda is not set: this is not torch's CUDA build")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    print(f"cuDNN: torch.backends.cudnn.version() = {cudnn}")
    nccl = torch.cuda.nccl.version()
    print(f"NCCL: torch.cuda.nccl.version() = {'.'.join(map(str, nccl)) if isinstance(nccl, tuple) else nccl}")
    loaded = mapped_nvidia_libraries()
    print("loaded from the nvidia-* wheels: " + ", ".join(loaded))
    for name, version in (("libcudnn", cudnn), ("libnccl", nccl)):
        if not version or not any(name in path for path in loaded):
            failures.append(f"{name} did not load")
    for failure in failures:
        print(f"maxout: error: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
