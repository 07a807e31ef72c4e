"""How fast a mistyped override is refused: the wall time of ``maxout train data.padding=sideways`` (exit 2, one
line) against the time the same command took before the quick check, when it imported torch, transformers and the
trainer first. The peer is that old path, still reachable: ``loading.load`` detects the device (torch) before it
checks anything. Both run as fresh processes, interleaved, in both orders (ABBA), so drift in the machine's load
hits both alike. Target (issue 28): the refusal in under 1.5 s of wall time on the 2-core CI machine.

    .venv/bin/python -m benchmarks.cli_refusal [--reps 5] [--override data.padding=sideways]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

# The old order: the device first (torch), then the whole config; the same one-line error comes out at the end.
OLD_PATH = ("import sys; from maxout import loading; from maxout.errors import MaxoutError\n"
            "try:\n    loading.load(sys.argv[1:])\nexcept MaxoutError as err:\n"
            "    print(f'maxout: error: {err}', file=sys.stderr); sys.exit(err.exit_code)")


def timed(command: list[str]) -> tuple[float, int, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    return time.perf_counter() - started, done.returncode, done.stderr.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--override", default="data.padding=sideways")
    args = parser.parse_args(argv)
    commands = {"maxout": [sys.executable, "-m", "maxout", "train", args.override],
                "device-first": [sys.executable, "-c", OLD_PATH, args.override]}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for rep in range(args.reps):
        order = list(commands) if rep % 2 == 0 else list(reversed(commands))
        for name in order:
            seconds, code, err = timed(commands[name])
            assert code == 2 and err.count("\n") == 0 and err.startswith("maxout: error:"), (name, code, err)
            times[name].append(seconds)
    print(f"{args.override!r}, {args.reps} interleaved repetitions (ABBA), wall seconds per refusal:")
    for name, values in times.items():
        print(f"  {name:13s} median {statistics.median(values):5.2f}  min {min(values):5.2f}  "
              f"max {max(values):5.2f}")
    ratio = statistics.median(times["device-first"]) / statistics.median(times["maxout"])
    print(f"  quick check is {ratio:.1f}x faster; target < 1.5 s: "
          f"{'met' if statistics.median(times['maxout']) < 1.5 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
