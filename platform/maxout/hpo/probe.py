"""One worker's training throughput, for ``hpo.workers=auto`` and the GPU memory check (auto_workers.py starts N of
these at once, each in the share of the device a worker would get).

    python -m maxout.hpo.probe '{"overrides": [...], "steps": 12}'

The study's own config (its batch, precision, model), trained for ``steps`` optimizer steps without tracking or
checkpoints: the trials' real training step, not a synthetic one. Prints one JSON line: steady samples/s (after
the throughput meter's warm-up steps), the peak reserved GPU memory and the peak resident set.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Sequence

from .. import hardware, loading
from ..train import train


def measure(overrides: Sequence[str], steps: int) -> dict:
    device = hardware.detect()
    hardware.apply_device_share(device)
    cfg = loading.load(list(overrides), device=device)
    cfg = dataclasses.replace(cfg, hpo=None,
                              tracking=dataclasses.replace(cfg.tracking, backend="none"),
                              checkpoint=dataclasses.replace(cfg.checkpoint, enabled=False),
                              train=dataclasses.replace(cfg.train, max_steps=steps, select_best="last"))
    metrics = train(cfg, progress=False, device=device, verbose=False).metrics
    return {"samples_per_s": metrics.get("perf/steady_samples_per_s", metrics.get("perf/samples_per_s")),
            "peak_reserved_gb": metrics.get("mem/peak_reserved_gb", 0.0),
            "peak_rss_gb": metrics.get("mem/peak_rss_gb", 0.0)}


def main(argv: Sequence[str]) -> int:
    args = json.loads(argv[1])
    print("MAXOUT_PROBE " + json.dumps(measure(args["overrides"], int(args["steps"]))), flush=True)
    return 0


if __name__ == "__main__":
    from ..errors import exit_without_collecting  # lazy: only when run as a process

    exit_without_collecting()  # a probe's exit is on the critical path of hpo.workers=auto's measurement
    sys.exit(main(sys.argv))
