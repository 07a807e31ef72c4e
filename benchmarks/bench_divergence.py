"""What the divergence watch costs per optimizer step (train/divergence.py): its record() alone, and a whole training
step with and without it, with clipping on (the default: the gradient norm comes free) and off (the watch computes
the norm itself).

    python benchmarks/bench_divergence.py              # MiniLM (the demo's model), CPU
    python benchmarks/bench_divergence.py --model tiny --rounds 40

Measured in one process, interleaved (with, without, without, with, ...: both orders), medians and ratios,
because the machine is noisy. On a GPU the watch's point is that it adds no host sync (tests/test_divergence.py
checks that with torch's sync detector); its kernels are a few scalar ops per step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


class NoWatch:
    def record(self, *args, **kwargs) -> None:
        pass


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from maxout import loading, metrics as m
    from maxout.tracking.tracker import NullTracker
    from maxout.train import train
    from maxout.train.divergence import DivergenceWatch
    from maxout.train.loop import train_step

    cfg = loading.load(["hardware=cpu", f"model={args.model}", "tracking=none", "train.max_steps=1",
                        "checkpoint.enabled=false"])
    s = train(cfg, tracker=NullTracker(), progress=False, verbose=False).setup
    s.model.train()
    group = [next(iter(s.train_loader))]
    meter = m.Throughput(s.device.torch_device, warmup_steps=0)
    params = [p for p in s.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)  # a step's worth of gradients for record() alone

    clip = s.clip_norm
    watch = DivergenceWatch()
    record_us = {"clip on": [], "clip off": []}
    step_s = {(c, w): [] for c in ("clip on", "clip off") for w in ("watch", "none")}
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    for r in range(args.rounds):
        for label in ("clip on", "clip off"):
            given = norm if label == "clip on" else None
            record_us[label].append(1e6 * timed(lambda: [watch.record(1, torch.tensor(0.5), given, params,
                                                                       s.precision.scaler) for _ in range(20)]) / 20)
        for label in ("clip on", "clip off"):
            s.clip_norm = clip if label == "clip on" else 0.0
            order = ("watch", "none") if r % 2 == 0 else ("none", "watch")  # both orders
            for which in order:
                s.divergence = DivergenceWatch() if which == "watch" else NoWatch()
                step_s[(label, which)].append(timed(lambda: train_step(s, group, meter)))
    print(f"model {args.model}, {sum(p.numel() for p in params):,} trainable params, micro-batch "
          f"{len(group[0]['labels'])}, {args.rounds} interleaved rounds, device {s.device.name}")
    for label in ("clip on", "clip off"):
        with_, without = (statistics.median(step_s[(label, w)]) for w in ("watch", "none"))
        print(f"{label:8s}: record() {statistics.median(record_us[label]):8.1f} us; step with the watch "
              f"{with_ * 1e3:8.1f} ms, without {without * 1e3:8.1f} ms, ratio {with_ / without:.3f}")


if __name__ == "__main__":
    main()
