"""The MLflow UI as a user sees it, in a real browser: headless Chromium (Debian's ``chromium``, driven through its
DevTools protocol as benchmarks/ui_screenshot.py does) on a real `mlflow server` over a store that a real
`maxout train` and `maxout hpo` wrote (issue 28, "Must show"):

- the experiment's Models tab lists the champion under its run's name, with its eval metrics;
- the champion's run page shows its three datasets (train, validation, test) with their roles;
- the registry's model list holds no ``.lock`` model (the promotion lock's stand-in models).

The page text is read from the DOM after MLflow's React app rendered it (the tables are ARIA grids: rows of
``columnheader`` / ``gridcell``). Screenshots go to ``$MAXOUT_SCREENSHOTS`` when set (the docs' are in
benchmarks/screenshots/: ``MAXOUT_SCREENSHOTS=benchmarks/screenshots pytest tests/test_ui_browser.py``), else to the
test's temporary folder.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
from pathlib import Path

import mlflow
import pytest

from benchmarks.ui_screenshot import CLICK, Browser, wait_for
from maxout import cli
from maxout.tracking.tracker import model_id

from . import services
from .conftest import TINY
from .store_template import new_store

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
REGISTERED = "ui-demo"
# Every cell of MLflow's tables, row by row: [role=row] > [role=columnheader|gridcell|cell] (ARIA grids and tables).
GRID = """JSON.stringify([...document.querySelectorAll('[role=row]')].map(r =>
  [...r.querySelectorAll(':scope > [role=columnheader], :scope > [role=gridcell], :scope > [role=cell]')]
    .map(c => c.innerText.trim())))"""
TEXT = "document.body ? document.body.innerText : ''"
# Scroll the Models tab's grid (AG Grid, columns rendered as they scroll into view) until the column COLUMN shows,
# then bring it to the left edge, next to the pinned model names: for the screenshot.
SCROLL_TO = """(async () => {
  const view = document.querySelector('.ag-body-horizontal-scroll-viewport');
  const header = () => [...document.querySelectorAll('.ag-header-cell')].find(e => e.innerText.trim() === COLUMN);
  const settle = ms => new Promise(done => setTimeout(done, ms));
  for (let x = 0; view && x < view.scrollWidth; x += 400) {
    view.scrollLeft = x;
    view.dispatchEvent(new Event('scroll'));
    await settle(200);
    if (header()) {
      view.scrollLeft = header().offsetLeft;
      view.dispatchEvent(new Event('scroll'));
      await settle(800);
      return true;
    }
  }
  return false;
})()"""


def eventually(check, timeout_s: float = 60):
    """``check()``'s value once it passes: the UI renders in steps (the first rows, then the rest, then the cells a
    scroll brings into view), later on a loaded machine; a wait on what the test reads, not on a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return check()
        except (AssertionError, ValueError, KeyError, StopIteration):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class Page:
    """One Chromium tab on the MLflow UI."""

    def __init__(self, browser: Browser, base: str, shots: Path):
        self.browser, self.base, self.shots = browser, base, shots

    def open(self, path: str, shows: str, width: int = 1600, height: int = 1000) -> None:
        self.browser.page("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                          mobile=False)
        self.browser.page("Page.navigate", url=self.base + path)
        assert wait_for(self.browser, f"({TEXT}).includes({json.dumps(shows)})", 90), (
            f"{path} never showed {shows!r}; it shows: {self.text()[:1500]}")
        time.sleep(2)  # the tables fill in after the first rows
        self.click("Close")  # MLflow's assistant panel, open on a first visit: it covers the right of the page

    def click(self, text: str) -> bool:
        done = self.browser.page("Runtime.evaluate", expression=CLICK % json.dumps(text), returnByValue=True)
        time.sleep(1.5)
        return bool(done["result"].get("value"))

    def value(self, expression: str) -> object:
        return self.browser.page("Runtime.evaluate", expression=expression, returnByValue=True,
                                 awaitPromise=True)["result"].get("value")

    def text(self) -> str:
        return str(self.value(TEXT))

    def grid(self) -> list[list[str]]:
        return json.loads(self.value(GRID))

    def shot(self, name: str) -> Path:
        path = self.shots / name
        path.write_bytes(base64.b64decode(self.browser.page("Page.captureScreenshot", format="png")["data"]))
        return path


@pytest.fixture
def small_data(tmp_path):
    from maxout.data import read_table

    val = read_table("projects/nli_demo/data/validation.csv")
    read_table("projects/nli_demo/data/train.csv").head(48).to_csv(tmp_path / "train.csv", index=False)
    val.head(32).to_csv(tmp_path / "validation.csv", index=False)
    val.tail(32).to_csv(tmp_path / "test.csv", index=False)
    return [f"data.train_path={tmp_path / 'train.csv'}", f"data.validation_path={tmp_path / 'validation.csv'}",
            f"data.test_path={tmp_path / 'test.csv'}"]


def models_table(page: Page) -> dict[str, dict[str, str]]:
    """The Models tab's rows by model name: {column: cell}. MLflow pins the name columns in a grid of their own, so a
    model's row is two rows in the DOM, the pinned one and the scrolling one, in the same order."""
    rows = page.grid()
    header = next(r for r in rows if "Source run" in r)  # the scrolling part's column names
    pinned = [r for r in rows if len(r) == 3 and r[1:] and r[0] not in ("Model name", "Model attributes")]
    scrolling = [r for r in rows if len(r) == len(header) and r is not header]
    assert len(pinned) == len(scrolling), rows
    return {p[0].splitlines()[-1]: dict(zip(header, s)) for p, s in zip(pinned, scrolling)}


def test_the_mlflow_ui_shows_datasets_scored_models_and_no_lock_model(tmp_path, small_data):
    if shutil.which("chromium") is None:
        pytest.fail("Debian's chromium is missing: apt-get install chromium (docker/install-engine.sh does)")
    shots = Path(os.environ.get("MAXOUT_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    backend = new_store(tmp_path / "mlflow.db")
    store = ["tracking=local", f"tracking.uri={backend}", f"tracking.artifact_location={(tmp_path / 'art').as_uri()}",
             "tracking.system_metrics=false", f"registry.name={REGISTERED}", "--no-progress"]
    # The fewest steps and trials that make it real: a 3-step `maxout train`, then a two-trial study of one epoch
    # (3 steps) each, all registering into one model, so the champion is whichever scored best.
    assert cli.main(["train", *TINY, *small_data, *store]) == 0
    assert cli.main(["hpo", "hardware=cpu", "model=tiny", "hpo.workers=1", "train.epochs=1", "hpo.n_trials=2",
                     "hpo.pruner.name=none",
                     "hpo.sampler.seed=3", f"hpo.storage={tmp_path / 'optuna.journal'}", *small_data, *store]) == 0

    client = mlflow.MlflowClient(backend)
    champion = client.get_model_version_by_alias(REGISTERED, "champion")
    model = client.get_logged_model(model_id(champion.source))
    run = client.get_run(champion.run_id)
    experiment = run.info.experiment_id
    logged = client.search_logged_models([experiment])  # the train run's, and each trial's that beat the best
    assert len(logged) >= 2, logged

    with services.mlflow_server(backend) as url:
        browser = Browser()
        try:
            browser.page("Page.enable")
            page = Page(browser, url, shots)

            # (a) The Models tab: the champion, under its run's name, with its eval metrics. The table is wide (a
            # column per metric and param, rendered as they scroll into view): a wide window shows them all.
            page.open(f"/#/experiments/{experiment}/models?workflowType=machine_learning", model.name,
                      width=9000)

            def every_model_scored() -> dict:
                table = models_table(page)
                assert model.name == run.info.run_name and model.name in table, (model.name, list(table))
                row = table[model.name]
                for key in ("eval/macro_f1", "eval/accuracy", "eval/loss"):
                    assert float(row[key]) == pytest.approx(run.data.metrics[key], rel=1e-9), (key, row)
                assert sorted(table) == sorted(m.name for m in logged)
                return row

            row = eventually(every_model_scored)
            validation = next(i.dataset for i in run.inputs.dataset_inputs if i.tags[0].value == "validation")
            assert row["Dataset"].startswith(f"{validation.name} (#{validation.digest})"), row  # what they scored on
            page.open(f"/#/experiments/{experiment}/models?workflowType=machine_learning", model.name,
                      width=2700, height=420)

            def scrolled_to_the_scores() -> bool:  # a scan that outran the grid's rendering is tried again
                assert page.value(SCROLL_TO.replace("COLUMN", json.dumps("eval/loss")))  # the eval/* columns
                return True

            eventually(scrolled_to_the_scores)
            page.shot("models_tab.png")

            # (b) The champion's run page: its three datasets, each with its role ("+2" unfolds the other two).
            page.open(f"/#/experiments/{experiment}/runs/{run.info.run_id}?workflowType=machine_learning",
                      "Datasets", height=900)
            assert page.click("+2"), page.text()[:2000]

            def every_dataset_with_its_role() -> None:
                shown = page.text()
                for given in run.inputs.dataset_inputs:
                    role = given.tags[0].value
                    assert f"{given.dataset.name} ({given.dataset.digest})\n{role.capitalize()}" in shown, (role,
                                                                                                           shown)

            eventually(every_dataset_with_its_role)
            assert {i.tags[0].value for i in run.inputs.dataset_inputs} == {"training", "validation", "test"}
            page.shot("run_datasets.png")

            # (c) The registry's model list: the registered model, and nothing else of maxout's making.
            page.open("/#/models", REGISTERED, height=500)
            page.shot("registry.png")

            def registered_names() -> list:
                names = [r[0] for r in page.grid() if r and r[0] not in ("Name", "")]
                assert REGISTERED in names, names
                return names

            names = eventually(registered_names)
            assert not [n for n in names if n.endswith(".lock")], names
        finally:
            browser.close()
