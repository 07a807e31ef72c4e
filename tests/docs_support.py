"""What the docs tests share: the reference generator (docs/hooks/gen_reference.py, which is no part of the
package: users who only train do not get it), loaded from its file, and the site built once per test module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def generator() -> ModuleType:
    """docs/hooks/gen_reference.py, as mkdocs' hook imports it (by that name), once per process."""
    if "gen_reference" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "hooks" / "gen_reference.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gen_reference"] = module
        spec.loader.exec_module(module)
    return sys.modules["gen_reference"]


def build_site(site_dir: Path) -> Path:
    """`mkdocs build --strict` in this process (what make docs runs): an mkdocs warning is an Abort here too."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"), site_dir=str(site_dir))
    assert config.strict, "mkdocs.yml must keep strict: true (a broken link must fail the build)"
    build(config)
    return site_dir
