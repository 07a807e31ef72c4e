"""The registry library against a real (temporary SQLite) MLflow store: promotion only when better, direction-aware,
the champion history behind rollback, the promotion locks (timeouts, dead and stale holders, old-style lock models),
and bad input leaving no half-written state. Candidates are real logged models without artifacts (cheap); test_registry_e2e.py trains."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus
from mlflow.exceptions import MlflowException

from maxout import cli
from maxout.registry import client as registry_client
from maxout.registry import lock as registry_lock
from maxout.registry import promotion as registry_promotion
from maxout.config import Config, RegistryConfig, TrackingConfig
from maxout.errors import MaxoutError

from . import warm_maxout
from .conftest import runs_in
from .store_template import new_store


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store for the module (creating a SQLite store costs seconds); each test uses its own model name."""
    uri = new_store(tmp_path_factory.mktemp("registry") / "mlflow.db")
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


def lock_leftovers(client, name: str) -> list[str]:
    """What a promotion lock could leave in the registry: lock tags on NAME, and any model but NAME whose name
    starts with it (the old lock's NAME.lock, or anything new)."""
    try:
        tags = [k for k in client.get_registered_model(name).tags if k.startswith(registry_lock.TAG_PREFIX)]
    except MlflowException as err:
        assert registry_client.missing(err), err
        tags = []
    others = [m.name for m in client.search_registered_models(max_results=1000)
              if m.name.startswith(name) and m.name != name]
    return sorted(tags + others)


def state(store, name: str) -> dict:
    """Everything promotion can change: versions with their tags, aliases, history, what the lock left."""
    client = store["client"]
    model = client.get_registered_model(name)
    return {"versions": {int(v.version): dict(v.tags) for v in client.search_model_versions(f"name='{name}'")},
            "aliases": {a: int(v) for a, v in model.aliases.items()},
            "history": model.tags.get(registry_client.HISTORY_TAG), "lock": lock_leftovers(client, name)}


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
        assert now["lock"] == []  # the lock leaves nothing in the registry
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
    assert before["aliases"] == {"champion": 1, "challenger": 3} and before["lock"] == []


def test_a_registration_that_cannot_succeed_creates_nothing(store):
    client = store["client"]
    cfg = cfg_for(store, "never-created")
    with pytest.raises(MaxoutError, match="no such logged model"):
        registry_promotion.register_and_promote("0" * 32, "models:/m-00000000000000000000000000000000", 0.9, cfg,
                                                "fp", "cpu", client=client)
    assert "never-created" not in {m.name for m in client.search_registered_models()}


class Holder:
    """A promotion lock held by another process (tests/lock_holder.py) until ``kill()``: a holder that dies."""

    def __init__(self, uri: str, name: str):
        self.proc = warm_maxout.popen([uri, name], program="tests.lock_holder", stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
        line = self.proc.stdout.readline()
        assert line.startswith("held "), line
        self.owner = line.split()[1]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)


def test_a_promotion_that_times_out_on_the_lock_leaves_nothing_and_a_dead_holders_lock_is_freed_at_once(store):
    cfg = cfg_for(store, "busy-model", lock_timeout_s=1.0)
    offer(store, cfg, 0.5)
    before = state(store, "busy-model")
    holder = Holder(store["uri"], "busy-model")  # a live holder in another process
    try:
        with pytest.raises(MaxoutError, match=r"timed out after 1s waiting for the promotion lock of 'busy-model' "
                                              r"\(SQLite file lock\), held by another process using .*mlflow.db"):
            offer(store, cfg, 0.9)  # would be champion
        assert state(store, "busy-model") == before
    finally:
        holder.kill()  # SIGKILL while holding: no release runs, the kernel frees the lock
    started = time.monotonic()
    outcome = offer(store, cfg_for(store, "busy-model", lock_timeout_s=20.0), 0.9)
    assert outcome.promoted and outcome.version == 3  # version 2 was deleted; numbers are never reused
    assert time.monotonic() - started < 10  # no TTL to wait out
    assert state(store, "busy-model")["lock"] == []


PROBE = """
import errno, fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, int(sys.argv[2]), 1, 0))
    print("got it")
except OSError as err:
    print(errno.errorcode[err.errno])
"""


def test_the_sqlite_lock_excludes_a_process_of_another_uid_that_can_write_the_store():
    """The lock is on the database file itself, so any user who can write the store (a container's user on a
    mounted store, a colleague's group-writable one) meets it; no lock file's mode can shut anyone out."""
    if os.geteuid() != 0:
        pytest.fail("this test switches to uid 65534 and needs root (the test machines and CI run as root)")
    tmp_path = Path(tempfile.mkdtemp(prefix="maxout-shared-store-"))  # pytest's tmp_path is root's alone (0700)
    tmp_path.chmod(0o1777)
    uri = new_store(tmp_path / "mlflow.db")
    MlflowClient(tracking_uri=uri).search_experiments()  # opens the store (connect() would also make it global)
    (tmp_path / "mlflow.db").chmod(0o666)
    client = MlflowClient(tracking_uri=uri)
    lock = registry_lock.promotion_lock(client, "shared-model", timeout_s=1)

    def probe() -> str:
        return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                               "-c", PROBE, str(tmp_path / "mlflow.db"), str(lock.offset)],
                              capture_output=True, text=True, check=True).stdout.strip()

    try:
        with lock:
            assert probe() == "EAGAIN"  # held by root: uid 65534 waits
        assert probe() == "got it"
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_lock_comes_from_the_store():
    def kind(uri: str) -> str:
        return type(registry_lock.promotion_lock(SimpleNamespace(_registry_uri=uri, tracking_uri=uri), "m")).__name__

    assert kind("sqlite:////tmp/x/mlflow.db") == kind("sqlite:///mlflow.db") == "FileRangeLock"
    assert kind("postgresql://u:p@db:5432/mlflow") == kind("postgresql+psycopg2://u@db/mlflow") == "AdvisoryLock"
    assert kind("http://127.0.0.1:5000") == kind("https://mlflow.example") == kind("sqlite://") == "TagLock"
    assert registry_lock.advisory_key("nli") == registry_lock.advisory_key("nli") != registry_lock.advisory_key("nlj")
    assert -2 ** 63 <= registry_lock.advisory_key("nli") < 2 ** 63


def tag_lock(store, name: str, ttl_s: float = 600, timeout_s: float = 30) -> registry_lock.TagLock:
    return registry_lock.TagLock(store["client"], name, ttl_s=ttl_s, timeout_s=timeout_s, poll_s=0.1)


def test_the_tag_lock_breaks_a_dead_holders_stale_ticket_and_leaves_no_tag(store, capsys):
    client = store["client"]
    offer(store, cfg_for(store, "orphan-model"), 0.5)
    dead = tag_lock(store, "orphan-model")
    dead.acquire()  # ...and never released, as if its process had been killed: nothing frees a tag
    assert lock_leftovers(client, "orphan-model") == [dead.key, dead.key + ".beat"]
    # A TTL of 3 s, not less: the holder's check below must come within the TTL of its last beat, and between them
    # lie a few MLflow reads, which a loaded machine can stretch past a second
    live = tag_lock(store, "orphan-model", ttl_s=3.0)
    started = time.monotonic()
    with live:
        assert time.monotonic() - started >= 3.0  # only after the TTL, on the waiter's own clock
        live.check()
        assert lock_leftovers(client, "orphan-model") == [live.key, live.key + ".beat"]
    assert lock_leftovers(client, "orphan-model") == []
    # unchanged for at least the TTL, on the waiter's clock; how much longer is the machine's (one poll's reads: a
    # loaded machine's took long enough to make it "2s" once)
    err = capsys.readouterr().err
    said = re.search(rf"breaking the stale promotion lock ticket 1 of orphan-model \(owner {re.escape(dead.owner)}, "
                     rf"unchanged for (\d+)s\)", err)
    assert said and int(said.group(1)) >= 3, err
    with pytest.raises(MaxoutError, match="promotion lock of 'orphan-model' was broken while held"):
        dead.check()  # the broken holder finds out before any write


def test_the_tag_lock_waits_for_a_live_holder_and_times_out_naming_it(store):
    client = store["client"]
    offer(store, cfg_for(store, "tagbusy-model"), 0.5)
    holder = tag_lock(store, "tagbusy-model")
    with holder:
        waiter = tag_lock(store, "tagbusy-model", timeout_s=1.0)
        with pytest.raises(MaxoutError, match=rf"timed out after 1s waiting for the promotion lock of 'tagbusy-model'"
                                              rf" \(registered-model tags\), held by {holder.owner} \(ticket 1\)"):
            waiter.acquire()
        assert lock_leftovers(client, "tagbusy-model") == [holder.key, holder.key + ".beat"]  # the waiter's gone
        holder.check()
    assert lock_leftovers(client, "tagbusy-model") == []


def test_bad_registry_config_is_a_one_line_usage_error_before_any_run(mlflow_store, capsys):
    from .conftest import TINY

    cases = {"registry.name=team/model": "registry.name='team/model' is invalid",
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
    lock = tag_lock(store, "stalled-model")
    lock.acquire()
    client.delete_registered_model_tag("stalled-model", lock.key)  # what a waiter does to a stale ticket
    with pytest.raises(MaxoutError, match="promotion lock of 'stalled-model' was broken while held"):
        registry_promotion.promote_if_better(client, "stalled-model", version, 0.9, "eval/macro_f1", "maximize", lock)
    lock.release()
    after = state(store, "stalled-model")
    assert after["aliases"] == before["aliases"] == {"champion": 1, "challenger": 1}  # challenger was put back
    assert after["history"] == before["history"] and after["lock"] == []


def old_style_lock(client, name: str, tickets: int = 2) -> None:
    """NAME.lock exactly as releases before this one left it: a model tagged maxout.lock_for, one version per
    ticket (a promoter that crashed, or queued, under the old code)."""
    client.create_registered_model(name + ".lock", tags={"maxout.lock_for": name},
                                   description=f"maxout's promotion lock for {name!r}: each live version is a ticket "
                                               f"(the lowest holds the lock). Safe to ignore.")
    for _ in range(tickets):
        client.create_model_version(name + ".lock", source="maxout-lock:///" + name,
                                    tags={"maxout.lock.owner": "old-host:1:deadbeef"}, await_creation_for=0)


def test_old_style_lock_models_are_deleted_on_first_use_and_by_cleanup_locks(store, capsys):
    client = store["client"]
    cfg = cfg_for(store, "legacy-model")
    old_style_lock(client, "legacy-model")
    old_style_lock(client, "elsewhere-model")
    client.create_registered_model("mine.lock")  # a user's own model that ends in .lock: never touched
    names = {m.name for m in client.search_registered_models()}
    assert {"legacy-model.lock", "elsewhere-model.lock", "mine.lock"} <= names
    assert offer(store, cfg, 0.9).promoted  # first use under the new lock: its NAME.lock goes
    assert "maxout: deleted legacy-model.lock, the registered model older maxout releases kept their promotion " \
           "lock in" in capsys.readouterr().err
    names = {m.name for m in client.search_registered_models()}
    assert "legacy-model.lock" not in names and "elsewhere-model.lock" in names
    assert not client.search_model_versions("name='legacy-model.lock'")
    assert cli.main(["registry", "cleanup-locks", "--tracking-uri", store["uri"]]) == 0
    assert capsys.readouterr().out.strip() == "maxout: deleted 1 old promotion lock model(s): elsewhere-model.lock"
    names = {m.name for m in client.search_registered_models()}
    assert not [n for n in names if n.endswith(".lock") and n != "mine.lock"] and "mine.lock" in names
    assert cli.main(["registry", "cleanup-locks", "--tracking-uri", store["uri"]]) == 0
    assert capsys.readouterr().out.strip() == "maxout: deleted 0 old promotion lock model(s)"
