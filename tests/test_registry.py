"""The registry library against a real (temporary SQLite) MLflow store: promotion only when better, direction-aware,
the champion history behind rollback, the promotion lock (timeouts, stale tickets), and bad input leaving no
half-written state. Candidates are real logged models without artifacts (cheap); test_registry_e2e.py trains."""

from __future__ import annotations

import json
import time

import pytest
from mlflow.entities import LoggedModelStatus

from maxout import cli, config
from maxout.registry import client as registry_client
from maxout.registry import lock as registry_lock
from maxout.registry import promotion as registry_promotion
from maxout.config import Config, RegistryConfig, TrackingConfig
from maxout.errors import MaxoutError

from .conftest import runs_in


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store for the module (creating a SQLite store costs seconds); each test uses its own model name."""
    uri = f"sqlite:///{tmp_path_factory.mktemp('registry') / 'mlflow.db'}"
    client = registry_client.connect(uri)
    return {"uri": uri, "client": client, "experiment": client.create_experiment("registry-tests")}


def candidate(store, value: float, metric: str = "eval/macro_f1") -> tuple[str, str]:
    """A finished run with ``metric`` = value and a logged model of it: (run_id, model_uri)."""
    client = store["client"]
    run = client.create_run(store["experiment"])
    client.log_metric(run.info.run_id, metric, value)
    client.set_terminated(run.info.run_id)
    model = client.create_logged_model(store["experiment"], name="model", source_run_id=run.info.run_id)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)  # as log_model leaves a finished model
    return run.info.run_id, f"models:/{model.model_id}"


def cfg_for(store, name: str, metric: str = "eval/macro_f1", direction: str = "maximize", **lock) -> Config:
    return Config(registry=RegistryConfig(name=name, metric=metric, direction=direction, **lock),
                  tracking=TrackingConfig(uri=store["uri"]))


def offer(store, cfg: Config, value: float) -> registry_promotion.Outcome:
    run_id, model_uri = candidate(store, value, cfg.registry.metric)
    return registry_promotion.register_and_promote(run_id, model_uri, value, cfg, "fp-test", "cpu",
                                                   client=store["client"])


def state(store, name: str) -> dict:
    """Everything promotion can change: versions with their tags, aliases, history, live lock tickets."""
    client = store["client"]
    model = client.get_registered_model(name)
    tickets = []
    if name + config.LOCK_SUFFIX in {m.name for m in client.search_registered_models()}:
        tickets = [v.version for v in client.search_model_versions(f"name='{name}{config.LOCK_SUFFIX}'")]
    return {"versions": {int(v.version): dict(v.tags) for v in client.search_model_versions(f"name='{name}'")},
            "aliases": {a: int(v) for a, v in model.aliases.items()},
            "history": model.tags.get(registry_client.HISTORY_TAG), "tickets": sorted(int(t) for t in tickets)}


def test_champion_moves_only_to_a_strictly_better_version_and_every_version_is_challenger(store):
    cfg = cfg_for(store, "f1-model")
    steps = [(0.70, 1, "champion: first champion (eval/macro_f1 0.7)"),
             (0.65, 1, "kept v1: eval/macro_f1 0.65 <= 0.7"),
             (0.70, 1, "kept v1: eval/macro_f1 0.7 <= 0.7"),  # a tie keeps the champion
             (0.80, 4, "champion: eval/macro_f1 0.8 > 0.7 (was v1)")]
    for version, (value, champion, reason) in enumerate(steps, start=1):
        outcome = offer(store, cfg, value)
        assert (outcome.version, outcome.champion_version, outcome.reason) == (version, champion, reason)
        now = state(store, "f1-model")
        assert now["aliases"] == {"champion": champion, "challenger": version}
        tags = now["versions"][version]
        assert tags["maxout.promotion"] == reason and tags["maxout.metric"] == "eval/macro_f1"
        assert float(tags["maxout.metric_value"]) == value
        assert tags["maxout.data_fingerprint"] == "fp-test" and tags["maxout.hardware_profile"] == "cpu"
        run = store["client"].get_run(tags["maxout.run_id"])  # the run says why, too
        assert run.data.tags["maxout.promotion"] == reason and run.data.tags["maxout.registry.version"] == str(version)
        assert now["tickets"] == []  # the lock is released after every promotion
    assert json.loads(state(store, "f1-model")["history"]) == [1, 4]
    mv = store["client"].get_model_version("f1-model", "4")
    assert mv.source.startswith("models:/m-")  # the logged model, not a runs:/ path


def test_minimize_promotes_the_lower_value(store):
    cfg = cfg_for(store, "loss-model", metric="eval/loss", direction="minimize")
    assert offer(store, cfg, 0.50).promoted
    better = offer(store, cfg, 0.40)
    assert better.promoted and better.reason == "champion: eval/loss 0.4 < 0.5 (was v1)"
    worse = offer(store, cfg, 0.45)
    assert not worse.promoted and worse.reason == "kept v2: eval/loss 0.45 >= 0.4"
    nan = offer(store, cfg, float("nan"))
    assert not nan.promoted and nan.champion_version == 2
    assert state(store, "loss-model")["aliases"] == {"champion": 2, "challenger": 4}


def test_promote_by_hand_and_rollback_walk_the_champion_history(store):
    cfg = cfg_for(store, "history-model")
    for value in (0.5, 0.6, 0.4):
        offer(store, cfg, value)  # champion v1 -> v2; v3 is worse
    client = store["client"]
    assert registry_promotion.promote(client, "history-model", 3).champion_version == 3
    assert json.loads(state(store, "history-model")["history"]) == [1, 2, 3]
    back = registry_promotion.rollback(client, "history-model")
    assert (back.champion_version, back.reason) == (2, "champion: rolled back from v3")
    assert registry_promotion.rollback(client, "history-model").champion_version == 1
    before = state(store, "history-model")
    with pytest.raises(MaxoutError, match="has no previous champion to roll back to"):
        registry_promotion.rollback(client, "history-model")
    assert state(store, "history-model") == before  # a refused rollback changes nothing
    assert before["aliases"] == {"champion": 1, "challenger": 3} and before["tickets"] == []


def test_a_registration_that_cannot_succeed_creates_nothing(store):
    client = store["client"]
    cfg = cfg_for(store, "never-created")
    with pytest.raises(MaxoutError, match="no such logged model"):
        registry_promotion.register_and_promote("0" * 32, "models:/m-00000000000000000000000000000000", 0.9, cfg,
                                                "fp", "cpu", client=client)
    assert "never-created" not in {m.name for m in client.search_registered_models()}


def test_a_promotion_that_times_out_on_the_lock_leaves_no_version_and_no_ticket(store):
    client = store["client"]
    cfg = cfg_for(store, "busy-model", lock_timeout_s=1.0)
    offer(store, cfg, 0.5)
    before = state(store, "busy-model")
    holder = registry_lock.PromotionLock(client, "busy-model", ttl_s=600)  # a live holder (keeps its lease)
    holder.acquire()
    try:
        with pytest.raises(MaxoutError, match=r"timed out after 1s waiting for the promotion lock of 'busy-model', "
                                              r"held by .*:\d+:"):
            offer(store, cfg, 0.9)  # would be champion
        after = state(store, "busy-model")
        assert after["tickets"] == [holder.ticket]  # only the holder's ticket
        assert {k: v for k, v in after.items() if k != "tickets"} == {k: v for k, v in before.items() if k != "tickets"}
    finally:
        holder.release()
    assert state(store, "busy-model")["tickets"] == []
    assert offer(store, cfg, 0.9).version == 3  # version 2 was deleted; numbers are never reused


def test_a_dead_holders_stale_ticket_is_broken(store, capsys):
    client = store["client"]
    cfg = cfg_for(store, "orphan-model", lock_ttl_s=1.0, lock_timeout_s=30.0)
    offer(store, cfg, 0.5)
    dead = registry_lock.PromotionLock(client, "orphan-model")
    dead.acquire()  # ...and never released, as if its process had been killed
    time.sleep(1.5)  # older than lock_ttl_s on the store's clock
    outcome = offer(store, cfg, 0.9)
    assert outcome.promoted and state(store, "orphan-model")["tickets"] == []
    assert f"breaking the stale promotion lock ticket {dead.ticket} of orphan-model.lock" in capsys.readouterr().err


def test_bad_registry_config_is_a_one_line_usage_error_before_any_run(mlflow_store, capsys):
    from .conftest import TINY

    cases = {"registry.name=team/model": "registry.name='team/model' is invalid",
             "registry.name=x.lock": "names ending in '.lock' are maxout's promotion locks",
             "registry.direction=up": "registry.direction='up' (valid: maximize, minimize)"}
    for override, message in cases.items():
        assert cli.main(["train", *TINY, *mlflow_store["overrides"], override]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("maxout: error: ") and "\n" not in err and message in err, err
    # registering needs a logged model and a metric the trainer reports: checked before training
    assert cli.main(["train", *TINY, "tracking=none", "registry.name=m"]) == 2
    assert "needs a logged model" in capsys.readouterr().err
    assert cli.main(["train", *TINY, *mlflow_store["overrides"], "registry.name=m", "registry.metric=eval/f2"]) == 2
    assert "registry.metric='eval/f2' is not a metric the trainer reports (valid: eval/loss" in capsys.readouterr().err
    assert runs_in(mlflow_store["uri"]) == []


def test_registry_cli_lists_promotes_and_explains_unknown_names(store, capsys):
    cfg = cfg_for(store, "cli-model")
    for value in (0.5, 0.7):
        offer(store, cfg, value)
    uri = ["--tracking-uri", store["uri"]]
    assert cli.main(["registry", "list", *uri]) == 0
    listing = capsys.readouterr().out
    assert "cli-model" in listing and ".lock" not in listing
    assert cli.main(["registry", "list", "cli-model", *uri]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["v2", "challenger,champion", "eval/macro_f1=0.7"]
    assert cli.main(["registry", "promote", "cli-model", "1", *uri]) == 0
    assert "cli-model@champion -> v1 (champion: promoted by hand (was v2))" in capsys.readouterr().out
    assert cli.main(["registry", "rollback", "cli-model", *uri]) == 0
    assert "cli-model@champion -> v2 (champion: rolled back from v1)" in capsys.readouterr().out
    for argv, message in [(["registry", "promote", "cli-model", "9"], "registered model 'cli-model' has no version 9 "
                                                                      "(aliases: challenger (v2), champion (v2); "
                                                                      "versions: 1, 2)"),
                          (["registry", "rollback", "no-such-model"], "no registered model 'no-such-model' in the "
                                                                      "registry (registered: ")]:
        assert cli.main([*argv, *uri]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("maxout: error: ") and "\n" not in err and message in err, err


def test_a_holder_that_lost_its_lock_writes_no_champion_and_restores_the_challenger(store):
    """A stalled holder whose ticket was broken finds out before writing champion, and undoes what it wrote."""
    client = store["client"]
    cfg = cfg_for(store, "stalled-model")
    offer(store, cfg, 0.5)
    run_id, model_uri = candidate(store, 0.9)
    version = registry_promotion.register(client, "stalled-model", model_uri, run_id=run_id,
                                          tags=registry_promotion.version_tags(run_id, "eval/macro_f1", 0.9,
                                                                               "maximize", "fp", "cpu"))
    before = state(store, "stalled-model")
    lock = registry_lock.PromotionLock(client, "stalled-model")
    lock.acquire()
    client.delete_model_version("stalled-model.lock", str(lock.ticket))  # what a waiter does to a stale ticket
    with pytest.raises(MaxoutError, match="promotion lock of 'stalled-model' was broken while held"):
        registry_promotion.promote_if_better(client, "stalled-model", version, 0.9, "eval/macro_f1", "maximize", lock)
    lock.release()
    after = state(store, "stalled-model")
    assert after["aliases"] == before["aliases"] == {"champion": 1, "challenger": 1}  # challenger was put back
    assert after["history"] == before["history"] and after["tickets"] == []
