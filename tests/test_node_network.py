"""A real local network: 5 node processes on 127.0.0.1 over 4 blocks (block 1 held twice).

One swarm serves the whole module; the tests run in file order and each leaves the network in
a state the next expects (the failover test, which kills a node, comes last).
"""
from __future__ import annotations

import math
import signal
import threading
import time

import pytest
import torch

from blocktrain.node.client import NetworkClient
from blocktrain.node.swarm.launcher import LocalSwarm
from blocktrain.node.swarm.run import SWARM_DEFAULTS

from test_utils.configs import TEST_CORPUS
from test_utils.reliability import operator_action

pytestmark = [pytest.mark.network, pytest.mark.slow]

MAX_STEPS = 400


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    data = TEST_CORPUS
    base = tmp_path_factory.mktemp("swarm")
    sw = LocalSwarm(base, run_id="nettest", overrides=SWARM_DEFAULTS, data=str(data),
                    extra_args=["--average-every", "10", "--average-period", "2", "--device", "cpu",
                                "--checkpoint-every", "50"])
    client = None
    try:
        sw.start_seed(block=0, args=["--max-steps", str(MAX_STEPS), "--train-duty", "0.5"])
        # block 1's two replicas average only when the test asks (POST /v1/average), so the test
        # can measure them right before and right after a round
        manual = ["--max-steps", str(MAX_STEPS), "--average-every", "1000000", "--average-period", "1e9", "--average-clock", "0"]
        sw.start_join(block=1, args=manual, wait=False)
        for b in (2, 3):
            sw.start_join(block=b, args=["--max-steps", str(MAX_STEPS)], wait=False)
        # the replica trains twice as long: if it joins after the first replica has finished and
        # downloads that state (a late joiner does), it still trains on and the two differ
        replica = ["--max-steps", str(2 * MAX_STEPS), *manual[2:]]
        sw.start_join(block=1, args=replica, wait=False)
        for n in sw.nodes[1:]:
            n.wait_ready()
        client = NetworkClient([sw.seed_maddr], "nettest")
        yield sw, client, data
    finally:
        if client is not None:
            client.close()
        sw.stop_all()


def _block_state(client, peer, b):
    _, tensors = client.hop_client.get_block_state_sync(peer, b, timeout=30)
    return tensors


def _distance(a, b):
    return math.sqrt(sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a))


def _wait(pred, timeout, what):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_swarm_trains_averages_replicas_and_chain_ce_falls(net):
    sw, client, data = net
    from blocktrain.blocks.data import resolve_data
    split = resolve_data(str(data))
    holders = client.holders()
    assert sorted(holders) == [0, 1, 2, 3] and len(holders[1]) == 2
    r1, r2 = (h.peer_id for h in holders[1])
    # the chain as every node starts it (deterministic init), scored on the same held-out windows
    from blocktrain.blocks.windows import eval_windows
    obj = client.objective
    fresh = [obj.build_block(b) for b in range(client.cfg.n_blocks)]
    windows = eval_windows(split.eval, client.cfg.seq_len, 8)
    ce_start = obj.score(obj.local_hops(fresh), windows, k=2, generator=torch.Generator().manual_seed(0)).ce
    goal = {n.name: MAX_STEPS for n in sw.nodes} | {sw.nodes[4].name: 2 * MAX_STEPS}
    _wait(lambda: all(n.get("/v1/status")["self"]["step"] >= goal[n.name] for n in sw.nodes), 300, "max steps")
    before = _distance(_block_state(client, r1, 1), _block_state(client, r2, 1))
    verdicts = {}

    def average(n):
        verdicts[n.name] = operator_action(n, "/v1/average", timeout=120)

    tries = []

    def whole(v):   # accepted, and every member's part averaged (a stalled member is named in the verdict)
        return v.get("accepted") and "stalled" not in (v.get("reason") or "")

    for attempt in range(4):   # a round can miss its partner, or its partner stall it; retry a bounded number of times
        ths = [threading.Thread(target=average, args=(n,)) for n in (sw.nodes[1], sw.nodes[4])]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        tries.append(dict(verdicts))
        if all(whole(v) for v in verdicts.values()):
            break
        if any("stalled" in (v.get("reason") or "") for v in verdicts.values()):
            time.sleep(16)   # a member that stalled a round is banned for the collateral 15 s (node/routing/bans.py)
    # (CI 94 failed here once: the last of 3 tries rejected by node4, "check loss rose", with node1 moved 0.03 %
    # and node4 67 %: after a round only node4 had, which reset node4's averaging weight, RELIABILITY.md gap 9)
    assert all(whole(v) for v in verdicts.values()), (tries, {
        n.name: {k: n.get("/v1/status")[k] for k in ("averaging", "self")} for n in (sw.nodes[1], sw.nodes[4])})
    after = _distance(_block_state(client, r1, 1), _block_state(client, r2, 1))
    assert before > 1e-3, "replicas never differed: the test would prove nothing"
    assert after < 1e-3 * before, (f"replicas not closer after averaging: {after} vs {before} before", verdicts,
                                   {n.name: n.get("/v1/status")["averaging"] for n in (sw.nodes[1], sw.nodes[4])})
    for n in (sw.nodes[1], sw.nodes[4]):   # and each one's own check says the round averaged every part
        av = n.get("/v1/status")["averaging"]   # (an earlier try some member stalled is counted partial, not hidden)
        assert av["last_completeness"] == pytest.approx(1.0, abs=0.05) and av["partial"] <= len(tries) - 1, av
    # no honest round was rejected; a block's only holder tries no round (no group can form: its
    # matchmaking would only burn CPU) and says so
    for n in sw.nodes:
        assert n.get("/v1/status")["averaging"]["rejected"] == 0
    alone = sw.nodes[0].get("/v1/status")["averaging"]   # block 0 has one holder in this network
    assert alone["attempted"] == 0 and alone["skipped_alone"] >= 1, alone
    me = sw.nodes[0].get("/v1/status")["self"]["train_duty"]   # the seed trained at --train-duty 0.5
    assert me["fraction"] == 0.5 and me["paused_s"] > 0, me
    ce_end = client.chain_ce(split.eval, n_windows=8, k=2)["chain_ce"]
    assert ce_end < ce_start - 0.5, (ce_start, ce_end)
    assert ce_end < math.log(256) - 0.5


def test_generation_through_http_of_a_node_without_block_0(net):
    sw, _, _ = net
    node = sw.nodes[2]   # holds block 2
    assert node.get("/v1/status")["self"]["block"] != 0
    r = node.post("/v1/generate", {"prompt": "The city of ", "max_bytes": 24, "mode": "one_sweep", "seed": 1})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["bytes_generated"] == 24 and len(out["text"]) > 0
    assert [h["block"] for h in out["route"]] == [0, 1, 2, 3]
    assert out["traversals"] == 1
    r = node.post("/v1/generate", {"prompt": "The ", "max_bytes": 4, "mode": "autoregressive", "seed": 1})
    assert r.status_code == 200 and r.json()["traversals"] == 4
    # bad requests are refused clearly and change nothing
    for bad in ({"prompt": "x", "max_bytes": 0}, {"prompt": "x", "mode": "sideways"}, {"nope": 1},
                {"prompt": "x", "max_bytes": 5000}):
        r = node.post("/v1/generate", bad)
        assert r.status_code == 422, (bad, r.status_code)
    assert node.get("/v1/status")["self"]["state"] == "online"


def test_late_joiner_downloads_current_state_then_averages(net):
    sw, client, _ = net
    holder = sw.nodes[2].get("/v1/status")
    holder_loss = holder["self"]["loss"]
    late = sw.start_join(block=2, args=["--max-steps", str(MAX_STEPS + 40)])
    assert late.info["downloaded_state"] is True and late.info["block"] == 2
    st = _wait(lambda: (s := late.get("/v1/status"))["losses"] and s, 60, "first steps of the late joiner")
    first_loss = st["losses"][0][2]
    assert first_loss < math.log(256) - 1.0, first_loss
    assert abs(first_loss - holder_loss) < 0.6, (first_loss, holder_loss)
    assert st["self"]["step"] >= holder["self"]["step"] - 1   # it continued the holder's count
    _wait(lambda: late.get("/v1/status")["averaging"]["succeeded"] >= 1, 180, "the late joiner's first round")


def test_restarted_node_resumes_from_checkpoint_with_same_identity(net):
    sw, _, _ = net
    node = sw.nodes[3]   # block 3
    before = node.get("/v1/status")["self"]
    assert node.stop() == 0, node.tail()
    ckpt = node.workdir / "ckpt" / "block03.safetensors"
    assert ckpt.exists()
    node.start()
    info = node.wait_ready()
    assert info["peer_id"] == before["peer_id"] and info["resumed"] is True
    after = node.get("/v1/status")["self"]
    assert after["step"] >= before["step"]


def test_killing_a_replica_mid_generation_fails_over_to_the_other(net):
    sw, client, _ = net
    asker = sw.nodes[2]
    probe = asker.post("/v1/generate", {"prompt": "The ", "max_bytes": 2, "mode": "autoregressive"}).json()
    assert "route" in probe, probe
    used = probe["route"][1]["peer"]           # the block-1 holder this node's router prefers
    victim = next(n for n in (sw.nodes[1], sw.nodes[4]) if n.info["peer_id"] == used)
    survivor = next(n for n in (sw.nodes[1], sw.nodes[4]) if n is not victim)
    result = {}

    def ask():
        result["r"] = asker.post("/v1/generate", {"prompt": "The ", "max_bytes": 300,
                                                  "mode": "autoregressive", "seed": 3})

    th = threading.Thread(target=ask)
    th.start()
    time.sleep(2.0)
    victim.signal(signal.SIGKILL)
    th.join(timeout=300)
    r = result["r"]
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["bytes_generated"] == 300
    assert [h["block"] for h in out["route"]] == [0, 1, 2, 3]
    assert out["route"][1]["peer"] == survivor.info["peer_id"]
    assert out["failovers"] >= 1
