"""The alias transaction: the alias and history writes of one promotion, undone together if any fails."""

from __future__ import annotations

import json
import sys
from typing import Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from .client import CHALLENGER, CHAMPION, HISTORY_TAG, alias_version, champion_history, missing


HISTORY_KEEP = 100


class AliasTransaction:
    """Alias and history writes that are undone together if any of them (or anything after) fails.

    Used only under the promotion lock, so the snapshot taken at entry is still the state to go back to.
    ``with tx:`` around the writes undoes them when the block raises."""

    def __init__(self, client: MlflowClient, name: str):
        self.client, self.name = client, name
        model = client.get_registered_model(name)
        self.before = {a: alias_version(model, a) for a in (CHAMPION, CHALLENGER)}
        self.history = champion_history(model)
        self._history_written = False

    def set_alias(self, alias: str, version: int) -> None:
        self.client.set_registered_model_alias(self.name, alias, str(version))

    def set_champion(self, version: int) -> None:
        history = (self.history + [version])[-HISTORY_KEEP:]
        self.set_history(history)
        self.set_alias(CHAMPION, version)

    def set_history(self, history: list[int]) -> None:
        self._history_written = True
        self.client.set_registered_model_tag(self.name, HISTORY_TAG, json.dumps(history))

    def __enter__(self) -> "AliasTransaction":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is not None:
            self.undo()
        return False  # the error that got us here is the one reported

    def undo(self) -> None:
        """Put aliases and history back; never raises, so the error that got us here is the one reported."""
        try:
            for alias, version in self.before.items():
                if version is not None:
                    self.client.set_registered_model_alias(self.name, alias, str(version))
                else:
                    self._drop_alias(alias)
            if self._history_written:
                self.client.set_registered_model_tag(self.name, HISTORY_TAG, json.dumps(self.history))
        except Exception as err:  # noqa: BLE001
            print(f"maxout: warning: could not restore the aliases of {self.name} ({type(err).__name__}); they "
                  f"were {self.before}, champion history {self.history}", file=sys.stderr)

    def _drop_alias(self, alias: str) -> None:
        try:
            self.client.delete_registered_model_alias(self.name, alias)
        except MlflowException as err:
            if not missing(err):
                raise
