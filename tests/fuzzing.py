"""What the fuzzers (test_fuzz_config.py, test_fuzz_data.py) share: Hypothesis' settings profiles and a CLI call that
captures what a user would see.

Two profiles, picked by the environment variable MAXOUT_FUZZ:
- ``ci`` (the default, what ``make test`` runs): a fixed seed (derandomize) and each test's own small example count,
  no example database, so every run draws the same examples;
- ``long`` (``make fuzz``): random seeds, FUZZ_SCALE times the examples per round, failures kept in .hypothesis/ and
  replayed first next time. ``make fuzz`` runs rounds until its time budget (FUZZ_MINUTES) is spent: past
  FUZZ_DEADLINE (epoch seconds) an example returns at once, so a round ends within one example of the deadline
  (Hypothesis has no time limit of its own, and a signal would reach maxout's own SIGINT/SIGTERM handling).
"""

from __future__ import annotations

import contextlib
import io
import os
import time
from typing import Sequence

from hypothesis import HealthCheck, settings

from maxout import cli

PROFILE = os.environ.get("MAXOUT_FUZZ", "ci")
SCALE = int(os.environ.get("FUZZ_SCALE", "3"))
# Each example starts Hydra, reads files or trains a model: seconds, not the milliseconds Hypothesis expects.
_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                      HealthCheck.data_too_large])
settings.register_profile("ci", derandomize=True, database=None, **_COMMON)
settings.register_profile("long", derandomize=False, **_COMMON)
if PROFILE not in ("ci", "long"):
    raise ValueError(f"MAXOUT_FUZZ={PROFILE!r} (valid: ci, long)")


def examples(ci: int) -> int:
    """A test's example count: ``ci`` in make test, FUZZ_SCALE times more per round of make fuzz."""
    return ci if PROFILE == "ci" else ci * SCALE


def out_of_time() -> bool:
    """make fuzz's deadline has passed: the example is skipped (passes at once)."""
    return PROFILE == "long" and time.time() > float(os.environ.get("FUZZ_DEADLINE", "inf"))


def fuzz_settings(ci: int) -> settings:
    return settings(settings.get_profile(PROFILE), max_examples=examples(ci))


def run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``maxout ARGV`` in this process. Any exception other than argparse's exit
    propagates: a traceback is what the fuzzers look for."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exit_:  # argparse
            code = int(exit_.code)
    return code, out.getvalue(), err.getvalue()


def one_error_line(stderr: str) -> str:
    """The single ``maxout: error: ...`` line a refused command prints; fails on anything else."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("maxout: error: "), stderr
    return lines[0]
