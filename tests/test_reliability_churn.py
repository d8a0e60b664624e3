"""Churn on one real swarm: four replicas of the same block (a one-block run) keep training while
replicas are SIGKILLed (the node and its whole process group: DHT, averager, p2pd) before, during
and after averaging rounds. The victims write a checkpoint after every step, so each kill lands at
a random moment of a write; after each kill the checkpoint must load (never a half file), and a
restarted victim resumes from it with the same peer id and averages again.

``BT_SOAK=1`` adds a soak test: 20 kill -9 events in one run (figures in RELIABILITY.md).
"""
from __future__ import annotations

import os
import random
import threading
import time

import pytest

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.node.client import NetworkClient

from test_utils.configs import TEST_CORPUS
from test_utils.reliability import (
    MANUAL_AVG, QUIET_TRAINING, TINY, RelSwarm, all_finite, average_together, average_until_accepted, block_state, kill9,
    report, restart, stop_swarm, wait_for,
)

pytestmark = [pytest.mark.reliability, pytest.mark.network]

RUN = "relchurn"
SOAK_EVENTS = 20


@pytest.fixture(scope="module")
def churn(tmp_path_factory):
    data = TEST_CORPUS
    base = tmp_path_factory.mktemp("relchurn")
    sw = RelSwarm(base, run_id=RUN, overrides=[*TINY, "n_blocks=1"], data=str(data),
                  extra_args=["--device", "cpu", *MANUAL_AVG, *QUIET_TRAINING])
    client = None
    try:
        c0 = sw.start_seed(block=0, args=["--checkpoint-every", "50"])
        c1 = sw.join(0, ["--checkpoint-every", "50"], name="c1")
        v1 = sw.join(0, ["--checkpoint-every", "1"], name="v1")   # victims: a checkpoint every step
        v2 = sw.join(0, ["--checkpoint-every", "1"], name="v2")
        for n in (c1, v1, v2):
            n.wait_ready()
        client = NetworkClient([sw.seed_maddr], RUN)
        yield {"sw": sw, "c0": c0, "c1": c1, "v1": v1, "v2": v2, "client": client}
    finally:
        if client is not None:
            client.close()
        stop_swarm(sw)


def _ckpt_path(node):
    return node.workdir / "ckpt" / ckpt.block_filename(0)


def _check_checkpoint(node) -> dict:
    """After a kill: the victim's checkpoint loads completely and holds finite weights."""
    c = ckpt.load_block(_ckpt_path(node), expected_block=0)
    assert all_finite(c.tensors), node.name
    leftovers = [p.name for p in _ckpt_path(node).parent.iterdir() if ".tmp-" in p.name]
    return {"step": c.step, "tmp_leftovers": len(leftovers)}


def _assert_accepted(v: dict, nodes) -> None:
    """Every node accepted the round; otherwise fail with their verdicts and their logs' tails."""
    if not all(x.get("accepted") for x in v.values()):
        logs = "\n".join(f"--- {n.name}\n{n.tail(15)}" for n in nodes)
        raise AssertionError(f"{v}\n{logs}")


def _survivors_finite(client, nodes) -> bool:
    return all(all_finite(block_state(client, n.info["peer_id"], 0)) for n in nodes)


def _steps(nodes) -> dict:
    return {n.name: n.get("/v1/status")["self"]["step"] for n in nodes}


def _kill_during_round(group, victim, delay: float) -> tuple[dict, float]:
    """Start a round on every node of ``group`` and SIGKILL ``victim`` ``delay`` s later."""
    out: dict = {}
    th = threading.Thread(target=lambda: out.update(average_together(group)))
    th.start()
    time.sleep(delay)
    t = kill9(victim)
    th.join(150)
    return out, t


def test_kill_before_during_and_after_rounds(churn):
    c0, c1, v1, v2, client = churn["c0"], churn["c1"], churn["v1"], churn["v2"], churn["client"]
    survivors = [c0, c1]
    wait_for(lambda: all(s >= 5 for s in _steps([c0, c1, v1, v2]).values()), 120, "every replica training")
    steps0 = _steps(survivors)
    events = []
    # 1. before a round: v2 dies, the other three average
    kill9(v2)
    cp = cp_v2 = _check_checkpoint(v2)
    v = average_until_accepted([c0, c1, v1])
    _assert_accepted(v, [c0, c1, v1])
    assert _survivors_finite(client, [c0, c1, v1])
    events.append({"when": "before", "victim": "v2", "checkpoint": cp, "next_round": "accepted"})
    # 2. during a round: v1 dies ~1 s after matchmaking ends (3 s window)
    during, _ = _kill_during_round([c0, c1, v1], v1, 3.5)
    cp = _check_checkpoint(v1)
    assert _survivors_finite(client, survivors)
    v = average_until_accepted(survivors)
    _assert_accepted(v, survivors)
    events.append({"when": "during", "victim": "v1", "checkpoint": cp,
                   "round_with_kill": {k: x.get("accepted", x.get("error")) for k, x in during.items()},
                   "next_round": "accepted"})
    # 3. restart: same identity, resumed from its checkpoint, rejoins averaging; then killed right after a round
    peer_before = v2.info["peer_id"]
    info = restart(v2)
    assert info["peer_id"] == peer_before and info["resumed"] is True, info
    assert v2.get("/v1/status")["self"]["step"] >= cp_v2["step"]    # resumed, not restarted from zero
    v = average_until_accepted([c0, c1, v2])
    _assert_accepted(v, [c0, c1, v2])
    kill9(v2)
    cp = _check_checkpoint(v2)
    v = average_until_accepted(survivors)
    _assert_accepted(v, survivors)
    assert _survivors_finite(client, survivors)
    events.append({"when": "after", "victim": "v2", "checkpoint": cp, "restart_resumed": True,
                   "rejoined_round": "accepted", "next_round": "accepted"})
    steps1 = _steps(survivors)
    assert all(steps1[k] > steps0[k] for k in steps0), (steps0, steps1)   # survivors kept training
    report("churn", kills=3, lost_checkpoints=0, non_finite=0, events=events, survivor_steps=[steps0, steps1])


@pytest.mark.skipif(os.environ.get("BT_SOAK") != "1", reason="soak: set BT_SOAK=1 (10-25 minutes)")
@pytest.mark.timeout(3600)
def test_soak_20_kill9_events(churn):
    c0, c1, v1, v2, client = churn["c0"], churn["c1"], churn["v1"], churn["v2"], churn["client"]
    survivors = [c0, c1]
    rng = random.Random(1234)
    t_start = time.monotonic()
    figures = {"events": 0, "lost_checkpoints": 0, "non_finite_survivors": 0, "restarts_resumed": 0,
               "restarts_same_peer_id": 0, "next_round_accepted": 0, "kills_during_round": 0,
               "tmp_leftovers_max": 0, "rounds_with_kill": {}}
    for i in range(SOAK_EVENTS):
        victim = (v1, v2)[i % 2]
        if not victim.alive:
            peer_before = victim.info["peer_id"]
            info = restart(victim)
            figures["restarts_resumed"] += bool(info["resumed"])
            figures["restarts_same_peer_id"] += info["peer_id"] == peer_before
        when = ("idle", "during", "after")[i % 3]
        if when == "idle":
            time.sleep(rng.uniform(0.2, 3.0))
            kill9(victim)
        elif when == "during":
            out, _ = _kill_during_round([c0, c1, victim], victim, rng.uniform(0.5, 6.0))
            figures["kills_during_round"] += 1
            key = ",".join(sorted(str(x.get("accepted", "err")) for x in out.values()))
            figures["rounds_with_kill"][key] = figures["rounds_with_kill"].get(key, 0) + 1
        else:
            average_together([c0, c1, victim])
            time.sleep(rng.uniform(0.0, 1.0))
            kill9(victim)
        figures["events"] += 1
        try:
            cp = _check_checkpoint(victim)
            figures["tmp_leftovers_max"] = max(figures["tmp_leftovers_max"], cp["tmp_leftovers"])
        except Exception as e:
            figures["lost_checkpoints"] += 1
            print(f"event {i}: checkpoint of {victim.name} did not load: {e}")
        if not _survivors_finite(client, survivors):
            figures["non_finite_survivors"] += 1
        v = average_until_accepted(survivors, attempts=3)
        figures["next_round_accepted"] += all(x.get("accepted") for x in v.values())
        report("soak_event", i=i, victim=victim.name, when=when, **{k: figures[k] for k in (
            "lost_checkpoints", "non_finite_survivors", "next_round_accepted")},
               elapsed=round(time.monotonic() - t_start, 1))
    figures["survivor_steps"] = _steps(survivors)
    figures["seconds"] = round(time.monotonic() - t_start, 1)
    report("soak", **figures)
    assert figures["lost_checkpoints"] == 0 and figures["non_finite_survivors"] == 0, figures
    assert figures["next_round_accepted"] == SOAK_EVENTS, figures
