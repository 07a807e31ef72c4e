"""``python -m maxout``: the command line.

Entry point. May import: cli.
"""

from .cli import run

raise SystemExit(run())
