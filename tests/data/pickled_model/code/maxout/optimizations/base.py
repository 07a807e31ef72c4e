"""The record of one optimization's decision: what was asked for, what runs, and why they differ."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Decision:
    """What was asked for, what runs, and why they differ."""

    name: str
    requested: Any
    effective: Any
    reason: str = ""

    @property
    def changed(self) -> bool:
        return self.requested != self.effective

    def params(self) -> dict[str, str]:
        out = {f"opt.{self.name}.requested": _fmt(self.requested), f"opt.{self.name}.effective": _fmt(self.effective)}
        if self.changed and self.reason:
            out[f"opt.{self.name}.reason"] = self.reason
        return out


def _fmt(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) or value is None else str(value)


def decide(name: str, requested: Any, support: tuple[bool, str], off: Any = False) -> Decision:
    """The common case: keep what was requested if supported, else fall back to ``off`` with the reason.

    A request that is already ``off`` needs no support check (nothing to turn off, nothing to explain).
    """
    ok, reason = support
    if requested == off or ok:
        return Decision(name, requested, requested)
    return Decision(name, requested, off, reason)


def named(decisions: Iterable[Decision], name: str) -> Decision:
    """The decision called ``name`` (decisions are read by name, never by their position in a list)."""
    found = next((d for d in decisions if d.name == name), None)
    if found is None:
        raise KeyError(f"no decision named {name!r}")
    return found
