"""Exactly-once promotion under concurrency, on each store's own lock: 8 promoters in separate processes
(tests/registry_race.py) offer different values at the same moment, directly on a SQLite store (the file lock)
and on PostgreSQL (the advisory lock); test_registry_e2e.py runs the same race through a tracking server (the tag
lock). Then the PostgreSQL lock's own faults (a live holder, a dead one, a holder whose session ended), and the tag
lock's mutual exclusion observed directly."""

from __future__ import annotations

import json
import time

import pytest

from maxout.errors import MaxoutError
from maxout.registry import client as registry_client
from maxout.registry import lock as registry_lock
from maxout.registry import promotion as registry_promotion

from . import warm_maxout
from .services import create_database, postgres
from .store_template import new_store
from .test_registry import Holder, candidate, cfg_for, lock_leftovers, offer

pytestmark = pytest.mark.slow
VALUES = [0.61, 0.74, 0.55, 0.83, 0.70, 0.79, 0.66, 0.58]


def race(uri: str, name: str = "race") -> None:
    """8 promoters at once on ``uri``: every one registers exactly one version, exactly one champion (the best),
    every champion in the history beat the one before it, and the lock leaves nothing in the registry."""
    client = registry_client.connect(uri)
    store = {"client": client, "experiment": client.create_experiment(f"{name}-experiment")}
    candidates = [[*candidate(store, v), v] for v in VALUES]
    proc = warm_maxout.run([uri, name, json.dumps(candidates)], program="tests.registry_race", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["exitcodes"] == [0] * 8 and len(result["pids"]) == 8
    assert not [o for o in result["outcomes"] if "error" in o], result["outcomes"]
    model = client.get_registered_model(name)
    tags = {int(v.version): dict(v.tags) for v in client.search_model_versions(f"name='{name}'")}
    value_of = {v: float(t["maxout.metric_value"]) for v, t in tags.items()}
    assert sorted(value_of.values()) == sorted(VALUES)  # every promoter registered exactly one version
    champion = int(model.aliases["champion"])
    assert value_of[champion] == max(VALUES)  # exactly one champion (one alias), and it is the best
    assert int(model.aliases["challenger"]) == 8 and lock_leftovers(client, name) == []
    # Serialized: each champion in the history beat the one before it, and said so against that very version.
    history = json.loads(model.tags[registry_client.HISTORY_TAG])
    assert history[-1] == champion and all(value_of[a] < value_of[b] for a, b in zip(history, history[1:]))
    reasons = {v: t["maxout.promotion"] for v, t in tags.items()}
    assert reasons[history[0]].startswith("champion: first champion")
    for before, after in zip(history, history[1:]):
        assert reasons[after].endswith(f"(was v{before})"), reasons
    promoted = sorted(v for v, r in reasons.items() if r.startswith("champion:"))
    assert promoted == sorted(history)  # no promotion was lost to a concurrent write


def test_eight_concurrent_promoters_on_sqlite_leave_exactly_one_champion_the_best(tmp_path):
    race(new_store(tmp_path / "mlflow.db"))


@pytest.fixture(scope="module")
def pg():
    with postgres() as admin:
        uri = create_database(admin, "mlflow")
        client = registry_client.connect(uri)  # MLflow creates its schema
        yield {"uri": uri, "client": client, "experiment": client.create_experiment("locks")}


def test_eight_concurrent_promoters_on_postgresql_leave_exactly_one_champion_the_best(pg):
    race(pg["uri"])


def test_a_postgresql_waiter_times_out_naming_the_holder_and_a_dead_holders_lock_is_freed_at_once(pg):
    cfg = cfg_for(pg, "pg-busy", lock_timeout_s=1.0)
    offer(pg, cfg, 0.5)
    holder = Holder(pg["uri"], "pg-busy")
    with pytest.raises(MaxoutError, match=rf"timed out after 1s waiting for the promotion lock of 'pg-busy' "
                                          rf"\(PostgreSQL advisory lock\), held by maxout promotion lock "
                                          rf"{holder.owner} \(server pid \d+\)"):
        offer(pg, cfg, 0.9)
    assert [int(v.version) for v in pg["client"].search_model_versions("name='pg-busy'")] == [1]  # v2 undone
    holder.kill()  # the server ends its session, which frees the lock: no TTL to wait out
    started = time.monotonic()
    assert offer(pg, cfg_for(pg, "pg-busy", lock_timeout_s=20.0), 0.9).promoted
    assert time.monotonic() - started < 10 and lock_leftovers(pg["client"], "pg-busy") == []


def test_a_postgresql_holder_whose_session_ended_writes_no_champion(pg):
    """A holder that stalls past lock_ttl_s loses its session (idle_session_timeout) and with it the lock; it
    finds out before writing champion and undoes what it wrote."""
    client = pg["client"]
    offer(pg, cfg_for(pg, "pg-stalled"), 0.5)
    run_id, model_uri = candidate(pg, 0.9)
    version = registry_promotion.register(client, "pg-stalled", model_uri, run_id=run_id,
                                          tags=registry_promotion.version_tags(run_id, "eval/macro_f1", 0.9,
                                                                               "maximize", "fp", "cpu"))
    lock = registry_lock.promotion_lock(client, "pg-stalled", ttl_s=1.0, timeout_s=10.0)
    lock.acquire()
    lock.check()
    time.sleep(2.5)  # stalled: idle longer than lock_ttl_s
    with pytest.raises(MaxoutError, match="promotion lock of 'pg-stalled' was lost while held: its PostgreSQL "
                                          "session ended"):
        registry_promotion.promote_if_better(client, "pg-stalled", version, 0.9, "eval/macro_f1", "maximize", lock)
    lock.release()
    model = client.get_registered_model("pg-stalled")
    assert {a: int(v) for a, v in model.aliases.items()} == {"champion": 1, "challenger": 1}  # put back
    with registry_lock.promotion_lock(client, "pg-stalled", timeout_s=5.0):
        pass  # the lock is free


def test_the_tag_lock_admits_one_holder_at_a_time_under_contention(tmp_path):
    """The bakery over tags, observed directly (tests/lock_stress.py): 5 processes x 3 rounds of an unguarded
    read-pause-write of a counter under the lock. Without a lock this loses increments and overlaps (checked by
    hand with 6 x 4: counter 4 of 24, 5 overlaps)."""
    uri = new_store(tmp_path / "mlflow.db")
    client = registry_client.connect(uri)
    client.create_registered_model("stress")
    proc = warm_maxout.run([uri, "stress", "5", "3", str(tmp_path)], program="tests.lock_stress", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"counter": 15, "overlaps": 0, "exitcodes": [0] * 5}
    assert lock_leftovers(client, "stress") == []
