"""The report's files: report.json (everything), report.md (for people and for benchmarks/RESULTS.md) and one PNG
chart per section that draws one, at most MAX_CHARTS: 8 files in all, what the GPU machine can send back. Written
whole after every section (temp file, then rename), so a report killed at the time limit still has every section
that finished."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from maxout.errors import first_line

MAX_CHARTS = 5  # + report.json, report.md and the command's own log (report.log) = 8 files
STATUS = {"ok": "ok", "failed": "FAILED", "timeout": "cut at its time limit", "crashed": "CRASHED",
          "skipped": "skipped", "pending": "not run yet", "running": "running"}


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write(out: Path, meta: dict, entries: list[dict], sections: dict, charts: bool = True) -> list[Path]:
    """Write report.json, report.md and the charts into ``out``; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if charts:
        written += draw(out, entries, sections)
    _atomic(out / "report.json", json.dumps({"meta": meta, "sections": entries}, indent=1, default=str))
    _atomic(out / "report.md", markdown(meta, entries, sections, [p.name for p in written]))
    return [out / "report.json", out / "report.md", *written]


# chart path -> the results it was drawn from: the report is rewritten after every section, and a section's chart is
# drawn again only when its results changed (every chart at every save cost the GPU call's host ~0.3 CPU-s a chart)
_DRAWN: dict[Path, str] = {}


def draw(out: Path, entries: list[dict], sections: dict) -> list[Path]:
    drawn = []
    for entry in entries:
        section = sections.get(entry["name"])
        path = out / f"{entry['name']}.png"
        if section is None or section.chart is None or not entry.get("results") or len(drawn) >= MAX_CHARTS:
            continue
        seen = json.dumps(entry["results"], sort_keys=True, default=str)
        if _DRAWN.get(path) == seen and path.is_file():
            drawn.append(path)
            continue
        _DRAWN.pop(path, None)
        try:
            if section.chart(entry["results"], path):
                drawn.append(path)
                _DRAWN[path] = seen
        except Exception as err:  # a chart must not cost the report
            entry["chart_error"] = f"{type(err).__name__}: {first_line(err)}"
    return drawn


def markdown(meta: dict, entries: list[dict], sections: dict, charts: list[str]) -> str:
    lines = [f"# GPU report: {meta.get('device', '?')}, {meta.get('date')}", "",
             f"`{meta.get('command')}`: scale **{meta.get('scale')}**"
             + (f", plan {meta['plan']}" if meta.get("plan") else "")
             + f", budget {meta.get('budget_s')} s, {meta.get('elapsed_s', 0):.0f} s so far; commit "
             f"{meta.get('commit') or 'unknown'}" + (f" ({meta['commit_source']})" if meta.get("commit_source") else "")
             + (f", git says {meta['commit_git']}" if meta.get("commit_git") not in (None, meta.get("commit")) else "")
             + (f"; TORCHINDUCTOR_COMPILE_THREADS={meta['compile_threads']}" if meta.get("compile_threads") else "")
             + (f"; inductor cache {meta['compile_cache']}" if meta.get("compile_cache") else "")
             + ".", "",
             "| section | status | seconds | note |", "|---|---|---|---|"]
    for e in entries:
        note = e.get("reason") or e.get("error") or ""
        seconds = f"{e['seconds']:.0f}" if e.get("seconds") is not None else "–"
        lines.append(f"| {e['name']} | {STATUS.get(e['status'], e['status'])} | {seconds} | "
                     f"{note.replace('|', '/')} |")
    left = [e["name"] for e in entries if e.get("budget_cut")]
    if left:
        lines += ["", f"Not finished for lack of time: {', '.join(left)}. Run them next: "
                      f"`python -m benchmarks.gpu_report --out DIR --sections {','.join(left)}`."]
    for e in entries:
        section = sections.get(e["name"])
        title = section.title if section else e["name"]
        lines += ["", f"## {title}", "", f"Status: {STATUS.get(e['status'], e['status'])}"
                  + (f" ({e.get('reason') or e.get('error')})" if e.get("reason") or e.get("error") else ""), ""]
        results = e.get("results") or {}
        if results:
            lines.append(_body(section, results))
        if f"{e['name']}.png" in charts:
            lines += ["", f"![{title}]({e['name']}.png)"]
        if e.get("log_tail"):
            lines += ["", "Last lines of its output:", "", "```", *e["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def _body(section: Any, results: dict) -> str:
    if section is not None and section.markdown is not None:
        try:
            return section.markdown(results)
        except Exception as err:  # a partial result may lack what the table wants: show the data instead
            return f"(table not drawn: {type(err).__name__}: {first_line(err)})\n\n```json\n" \
                   f"{json.dumps(results, indent=1, default=str)[:6000]}\n```"
    return f"```json\n{json.dumps(results, indent=1, default=str)[:6000]}\n```"
