"""benchmarks/suite_time.py: the summary of a suite run's JUnit XML and CPU samples."""

from __future__ import annotations

from datetime import datetime

from benchmarks import suite_time

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="0" failures="0" skipped="0" tests="4"
 time="100.0" timestamp="{stamp}">
<testcase classname="tests.test_a" name="test_slow" time="70.0" />
<testcase classname="tests.test_a" name="test_quick[x]" time="1.0" />
<testcase classname="tests.test_b" name="test_middle" time="20.0" />
<testcase classname="tests.test_b" name="test_small" time="9.0" />
</testsuite></testsuites>
"""


def stat_line(t: float, user: int, idle: int) -> str:
    return f"{t:.1f} cpu  {user} 0 0 {idle} 0 0 0 0 0 0\n"


def test_the_summary_says_how_the_time_is_spread_and_how_busy_the_workers_and_cores_were(tmp_path, capsys):
    start = datetime(2026, 12, 2, 18, 0, 0)
    junit = tmp_path / "results.xml"
    junit.write_text(JUNIT.format(stamp=start.isoformat()))
    t0 = start.timestamp()
    # before pytest's window (the install): all idle, left out; inside it, 300 of 400 ticks busy
    cpu = tmp_path / "cpu.log"
    cpu.write_text(stat_line(t0 - 50, 0, 0) + stat_line(t0 + 1, 0, 1000) + stat_line(t0 + 50, 150, 1050)
                   + stat_line(t0 + 99, 300, 1100) + stat_line(t0 + 200, 300, 5000))
    assert suite_time.main(["summary", "--junit", str(junit), "--cpu", str(cpu), "--workers", "2", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:3] == [
        "4 tests, 100 s of test time summed, pytest's wall 100 s",
        "workers busy: 50 s each on average of 100 s (50%), 2 workers",
        "CPU busy (all cores, /proc/stat samples inside pytest's window): 75%"]
    assert "| 60 s | 1 | 70 | 70% |" in out and "| 15 s | 2 | 90 | 90% |" in out and "| 5 s | 3 | 99 | 99% |" in out
    assert "| 1 s | 4 | 100 | 100% |" in out
    tests = out.split("slowest 2 tests:\n")[1].split("\n\n")[0].splitlines()
    assert [line.split()[-1] for line in tests] == ["tests.test_a::test_slow", "tests.test_b::test_middle"]
    modules = out.split("slowest 2 modules:\n")[1].splitlines()
    assert [line.split() for line in modules] == [["71.0", "tests.test_a"], ["29.0", "tests.test_b"]]


def test_the_sampler_writes_lines_the_summary_reads(tmp_path):
    out = tmp_path / "cpu.log"
    suite_time.sample(out, every_s=0.01, count=3)
    samples = suite_time.read_samples(out)
    assert len(samples) == 3 and all(len(values) >= 8 for _, values in samples)
    assert samples[0][0] <= samples[-1][0]
    assert suite_time.cpu_busy(samples) is None or 0 <= suite_time.cpu_busy(samples) <= 1


def test_a_missing_results_file_is_one_line_naming_it(tmp_path, capsys):
    assert suite_time.main(["summary", "--junit", str(tmp_path / "none.xml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("suite_time: --junit ") and "none.xml" in err and "\n" not in err
