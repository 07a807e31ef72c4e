"""Table cells as text: which cells hold no text (null, NaN, empty or blank) or something that is not text at all,
and how the rows that hold them are named in a one-line message.

Training data (data.py) and prediction input (serving/inference.py) apply the same rules, so a row that training
refuses is a row that prediction refuses too. Rows are numbered as a person counts them: the first data row is
row 1, whatever the file format (a CSV's header is not a row).

Ground floor. May import: nothing.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import pandas as pd
from pandas.api.types import is_scalar

SHOWN = 5  # row numbers a message names before it says "and N more"


def missing(value: Any) -> bool:
    """No text: None, NaN / pandas NA, or a string of whitespace only (pandas reads an empty CSV cell as '')."""
    if isinstance(value, str):
        return not value.strip()
    return is_scalar(value) and bool(pd.isna(value))


def not_text(value: Any) -> bool:
    """A value that is there but is not a string (a number, a list, a mapping from JSON or Parquet)."""
    return not isinstance(value, str) and not missing(value)


def positions(column: Iterable[Any], test: Any = missing) -> list[int]:
    """0-based positions of the cells of ``column`` for which ``test`` holds."""
    return [i for i, value in enumerate(column) if test(value)]


def rows(found: Sequence[int]) -> str:
    """'rows 3, 7 and 12' or 'rows 3, 7, 12, 20, 31 and 9 more', from 0-based positions (counting data rows from 1)."""
    numbers = [str(i + 1) for i in sorted(found)]
    if len(numbers) == 1:
        return f"row {numbers[0]}"
    if len(numbers) <= SHOWN:
        return f"rows {', '.join(numbers[:-1])} and {numbers[-1]}"
    return f"rows {', '.join(numbers[:SHOWN])} and {len(numbers) - SHOWN} more"
