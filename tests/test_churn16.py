"""Sixteen real nodes of a 4-block run on this machine (tiny blocks, one torch thread each) under
churn: every 30 s one node (never the seeder, the others' initial peer) is SIGKILLed with its
whole process group and the one killed before it restarts from its checkpoint directory, i.e.
2 kills and 2 restarts a minute. A client generates through the network all along.

Asserted: every block keeps a live holder (the test knows which processes are alive and which
block each holds), 100 % of generations succeed while it does, averaging rounds form groups in
every block, and after the churn every node still alive answers and no process survives teardown.

The run trains the objective ``BT_CHURN_OBJECTIVE`` names (default ``pipeline``, what ``bt-node seed``
starts; ``paper`` trains block-locally, and its nodes rebalance). Until 2026-12-04 the test named none,
so it ran the config's ``paper`` (``LocalSwarm``'s default), not what a new run trains.

Runs only when asked: ``BT_CHURN_MINUTES=N`` churns for N minutes (it starts 16 nodes, which takes
minutes on a 2-core machine, so the default suite skips it to stay well under 15 minutes); with
``BT_RELIABILITY_LOG=path.jsonl`` the figures (also the simulator's calibration: join-to-serving
time, round duration, hop failures) are appended there (RELIABILITY.md / BENCHMARKS.md).
"""
from __future__ import annotations

import os
import random
import statistics
import threading
import time

import pytest

from blocktrain.node.client import NetworkClient

from test_utils.configs import TEST_CORPUS
from test_utils.reliability import QUIET_TRAINING, TINY, RelSwarm, kill9, report, stop_swarm

MINUTES = float(os.environ.get("BT_CHURN_MINUTES", "0"))
OBJECTIVE = os.environ.get("BT_CHURN_OBJECTIVE", "pipeline")
pytestmark = [pytest.mark.network, pytest.mark.slow, pytest.mark.reliability,
              pytest.mark.timeout(int(1500 + MINUTES * 90)),
              pytest.mark.skipif(MINUTES <= 0, reason="16 nodes under churn run only when asked: BT_CHURN_MINUTES=2 "
                                 "(or more) pytest -n 0 tests/test_churn16.py")]

RUN = "churn16"
N_NODES, N_BLOCKS, KILL_EVERY_S = 16, 4, 30.0
# nodes train a quarter of the wall time (QUIET_TRAINING): 16 nodes training flat out on 2 cores starve the
# restarts, the status polls and the generations the test measures
ARGS = ["--device", "cpu", "--average-every", "30", "--checkpoint-every", "50", "--rebalance-dwell", "120",
        *QUIET_TRAINING]


class Monitor:
    """Ground truth, not announcements: which node processes are alive (checked at every sample) and
    which block each reports (its own /v1/status, polled by one thread per node every ~3 s, so one slow
    node does not hold up the others' view); a coverage sample every ~2 s; generations through a client
    every ~2 s; every rebalancing move any node reports (a killed node's list dies with it)."""

    SAMPLE_S, POLL_S = 2.0, 3.0

    def __init__(self, nodes, client):
        self.nodes, self.client = nodes, client
        self.block: dict[str, int] = {}
        self.down: set[str] = set()                  # killed and not yet restarted/ready
        self.samples: list[tuple[float, bool]] = []  # (time, every block has a live holder)
        self.uncovered: list[tuple[float, list[int]]] = []   # (time, blocks with no live holder)
        self.gens: list[tuple[float, bool, bool, int, str]] = []   # time, covered, ok, failovers, error
        self.moves: dict[tuple[str, float], dict] = {}             # (node, at) -> the node's move record
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def holding(self) -> set[int]:
        with self.lock:
            return {self.block[n.name] for n in self.nodes if n.name not in self.down and n.alive}

    def covered(self) -> bool:
        return self.holding() >= set(range(N_BLOCKS))

    def poll_node(self, n) -> None:
        while not self.stop.wait(self.POLL_S):
            if n.name in self.down or not n.alive:
                continue
            try:
                me = n.get("/v1/status", timeout=10)["self"]
            except Exception:
                continue
            with self.lock:
                if n.name not in self.down:
                    self.block[n.name] = me["block"]
                for mv in (me.get("rebalance") or {}).get("moves", []):
                    self.moves[(n.name, mv["at"])] = {"node": n.name, **mv}

    def sample(self) -> None:
        while not self.stop.wait(self.SAMPLE_S):
            held = self.holding()
            self.samples.append((time.time(), held >= set(range(N_BLOCKS))))
            if not self.samples[-1][1]:
                self.uncovered.append((time.time(), sorted(set(range(N_BLOCKS)) - held)))

    def generate(self) -> None:
        while not self.stop.wait(2.0):
            covered = self.covered()
            try:
                out = self.client.generate(b"The ", 8)
                self.gens.append((time.time(), covered and self.covered(), True, out["failovers"], ""))
            except Exception as e:
                self.gens.append((time.time(), covered and self.covered(), False, 0, f"{type(e).__name__}: {e}"))

    def threads(self) -> list[threading.Thread]:
        return [threading.Thread(target=f, args=a, daemon=True)
                for f, a in [(self.sample, ()), (self.generate, ()), *((self.poll_node, (n,)) for n in self.nodes)]]


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 1) if xs else None


def without_block(args: list[str]) -> list[str]:
    """A join command line without its ``--block N``: the node picks the least-held block itself."""
    i = args.index("--block")
    return args[:i] + args[i + 2:]


def test_sixteen_nodes_under_churn(tmp_path):
    rng = random.Random(15)
    sw = RelSwarm(tmp_path, run_id=RUN, overrides=[*TINY, f"n_blocks={N_BLOCKS}", f"objective={OBJECTIVE}"], data=str(TEST_CORPUS),
                  extra_args=ARGS)
    client, mon, threads = None, None, []
    join_s: list[float] = []
    try:
        t_start = time.monotonic()
        sw.start_seed(block=0)
        for batch in range(1, N_NODES, 5):   # a few at a time: a loaded 2-core machine
            group = [sw.join(i % N_BLOCKS, name=f"n{i:02d}") for i in range(batch, min(batch + 5, N_NODES))]
            for n in group:
                n.wait_ready(timeout=300)
        startup_s = time.monotonic() - t_start
        client = NetworkClient([sw.seed_maddr], RUN)
        mon = Monitor(sw.nodes, client)
        for n in sw.nodes:
            mon.block[n.name] = n.info["block"]
        threads = mon.threads()
        t0_wall = time.time()
        for th in threads:
            th.start()

        victims = sw.nodes[1:]
        restarting: list[threading.Thread] = []
        restart_errors: list[str] = []

        pinned_args = {n.name: list(n.args) for n in victims}
        restarts_log: list[dict] = []

        def restart(n, pinned: bool) -> None:   # in a thread, so that the kills keep their 30 s cadence
            # half the restarts come back on their --block (an operator's pinned block), the other half
            # without it (a returning volunteer: it takes the least-held block, downloading it if new)
            n.args = pinned_args[n.name] if pinned else without_block(pinned_args[n.name])
            t0 = time.monotonic()
            try:
                n.start(env=getattr(n, "env", None))
                n.wait_ready(timeout=300)
            except Exception as e:
                restart_errors.append(f"{n.name}: {type(e).__name__}: {e}")
                return
            join_s.append(time.monotonic() - t0)
            restarts_log.append({"node": n.name, "pinned": pinned, "block_before": mon.block.get(n.name),
                                 "block": n.info["block"], "s": round(join_s[-1], 1)})
            with mon.lock:
                mon.block[n.name] = n.info["block"]
                mon.down.discard(n.name)

        killed, kills = None, 0
        t_next = time.monotonic() + KILL_EVERY_S
        t_end = time.monotonic() + MINUTES * 60
        while t_next <= t_end:
            time.sleep(max(0.0, t_next - time.monotonic()))
            t_next += KILL_EVERY_S
            with mon.lock:
                alive = [n for n in victims if n.name not in mon.down]
            v = rng.choice(alive)
            with mon.lock:
                mon.down.add(v.name)
            kill9(v)
            kills += 1
            if killed is not None:   # restart the one killed before: it resumes its checkpoint
                restarting.append(threading.Thread(target=restart, args=(killed, len(restarting) % 2 == 0),
                                                   daemon=True))
                restarting[-1].start()
            killed = v
        if killed is not None:
            restarting.append(threading.Thread(target=restart, args=(killed, len(restarting) % 2 == 0), daemon=True))
            restarting[-1].start()
        for th in restarting:
            th.join(timeout=330)
        restarts = len(join_s)
        assert not restart_errors, restart_errors
        time.sleep(10)
        mon.stop.set()
        for th in threads:
            th.join(timeout=120)

        # figures from every node (all alive again)
        sts = [n.get("/v1/status", timeout=30) for n in sw.nodes]
        per_block: dict[int, dict] = {}
        round_s: list[float] = []
        for st in sts:
            a, b = st["averaging"], st["self"]["block"]
            d = per_block.setdefault(b, {"attempted": 0, "succeeded": 0, "groups": []})
            d["attempted"] += a["attempted"]
            d["succeeded"] += a["succeeded"]
            d["groups"] += [g for _, g, ok, _ in a["history"] if ok]
            round_s += a["round_seconds"]
        for n, st in zip(sw.nodes, sts):
            for mv in st["self"]["rebalance"].get("moves", []):   # a chain-trained run does not rebalance
                mon.moves[(n.name, mv["at"])] = {"node": n.name, **mv}
        moves = sorted(mon.moves.values(), key=lambda mv: mv["at"])
        covered = [c for _, c in mon.samples]
        gens_cov = [g for g in mon.gens if g[1]]
        ok = sum(1 for g in gens_cov if g[2])
        hops = sum(1 for g in mon.gens if g[2]) * N_BLOCKS
        failovers = sum(g[3] for g in mon.gens if g[2])
        figures = dict(
            objective=OBJECTIVE, nodes=N_NODES, blocks=N_BLOCKS, churn_minutes=MINUTES, kills=kills, restarts=restarts,
            startup_s=round(startup_s, 1), coverage=round(sum(covered) / max(1, len(covered)), 4),
            coverage_samples=len(covered), sample_every_s=Monitor.SAMPLE_S,
            uncovered=[(round(t - t0_wall, 1), b) for t, b in mon.uncovered][:20], generations=len(mon.gens), generations_while_covered=len(gens_cov),
            generations_ok_while_covered=ok, failovers=failovers, hop_failure_rate=round(failovers / max(1, hops), 4),
            join_to_serving_s=[round(x, 1) for x in join_s],
            join_to_serving_median_s=round(statistics.median(join_s), 1) if join_s else None,
            restarts_log=restarts_log,
            pinned_median_s=_median([r["s"] for r in restarts_log if r["pinned"]]),
            unpinned_median_s=_median([r["s"] for r in restarts_log if not r["pinned"]]),
            round_s_median=round(statistics.median(round_s), 2) if round_s else None,
            round_s_p90=round(sorted(round_s)[int(0.9 * (len(round_s) - 1))], 2) if round_s else None,
            averaging={b: {"attempted": d["attempted"], "succeeded": d["succeeded"],
                           "participation": round(d["succeeded"] / max(1, d["attempted"]), 3),
                           "mean_group": round(statistics.mean(d["groups"]), 2) if d["groups"] else 0}
                       for b, d in sorted(per_block.items())},
            rebalancing_moves=len(moves),
            moves=[{k: mv.get(k) for k in ("node", "from", "to", "took_s", "why")} | {"at": round(mv["at"] - t0_wall, 1)}
                   for mv in moves],
            errors=[g[4] for g in mon.gens if not g[2]][:5],
            # chain-trained runs: each node's part of the training since its last start
            pipeline=[{"node": n.name, "block": st["self"]["block"],
                       **{k: (st["self"]["pipeline"] or {}).get(k)
                          for k in ("received", "answered", "failed_downstream", "steps", "lost")}}
                      for n, st in zip(sw.nodes, sts) if st["self"]["pipeline"] is not None])
        report("churn16", **figures)
        assert kills >= 2 * MINUTES - 1 and restarts == kills
        # a holder that gets micro-batches answers some (a replica that joined after its block's first holder
        # answered none before the probe limit left the chain below its margins: RELIABILITY "Gaps found" 7)
        starved = [p for p in figures["pipeline"] if (p["received"] or 0) >= 20 and not p["answered"]]
        assert not starved, starved
        assert covered and all(covered), figures
        assert gens_cov and ok == len(gens_cov), figures
        assert sorted(per_block) == list(range(N_BLOCKS)), figures
        assert all(d["succeeded"] > 0 for d in per_block.values()), figures
    finally:
        if mon is not None:
            mon.stop.set()
            for th in threads:
                th.join(timeout=60)
        if client is not None:
            client.close()
        stop_swarm(sw, grace=30)
