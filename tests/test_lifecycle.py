"""Nodes stop when told and leave nothing behind (issue 14), on real processes:

* ``bt-node seed`` / ``join`` given Ctrl-C on a pseudo-terminal, SIGINT or SIGTERM to its pid or to
  its whole process group: exit 0 within 10 s, a final checkpoint at least as far as the step the
  node had reached, its DHT announcement withdrawn (a separate DHT reader no longer sees it, well
  within the 30 s an unwithdrawn announcement would live), and none of its processes (p2pd; with
  BT_HIVEMIND_IN=process also the DHT and averager processes and torch's shm manager) left; a second
  signal exits at once;
* ``bt-node swarm --keep-running`` given the same: exit 0 within 10 s, every node's final
  checkpoint written, none of its processes left;
* SIGKILL of a node or of ``swarm``: every process it grew gone within 10 s, on its own (a swarm's
  nodes even leave gracefully: the launcher gives them a parent-death SIGTERM).

The nodes bind HTTP port 0 and report the port they got (ready file, ``/v1/status``).
One anchor node (a one-block run of its own) gives the tested nodes a DHT to announce in and the
test's DHT reader a peer to ask.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from blocktrain.blocks.checkpoint import block_filename, load_block
from blocktrain.p2p.discovery import Discovery

from test_utils.configs import TEST_CORPUS
from test_utils.lifecycle import Command, describe, kill_all, kill_all_procs, running, wait_gone
from test_utils.reliability import QUIET_TRAINING, TINY, report, wait_for
from test_utils.wire_procs import JsonLinesProc

pytestmark = [pytest.mark.reliability, pytest.mark.network]

ANCHOR_RUN = "lc-anchor"
SETS = [x for kv in ["objective=paper", *TINY] for x in ("--set", kv)]   # a lone seed that trains alone
NODE_ARGS = ["--data", str(TEST_CORPUS), "--http-port", "0", "--checkpoint-every", "1000000", "--device", "cpu",
             *QUIET_TRAINING]
EXIT_BOUND_S = 10.0


def _ready(cmd: Command, ready_file: Path, timeout: float = 120.0) -> dict:
    wait_for(lambda: ready_file.exists() or cmd.proc.poll() is not None, timeout, f"{ready_file}")
    if not ready_file.exists():
        raise AssertionError(f"exited with {cmd.proc.returncode} before ready:\n{cmd.output()[-3000:]}")
    return json.loads(ready_file.read_text())


def _status(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=20).json()


@pytest.fixture(scope="module")
def anchor(tmp_path_factory):
    d = tmp_path_factory.mktemp("anchor")
    cmd = Command(["seed", "--run-id", ANCHOR_RUN, *SETS, "--block", "0", *NODE_ARGS, "--quiet",
                   "--checkpoint-dir", str(d / "ckpt"), "--ready-file", str(d / "ready.json")], d / "log")
    procs = []
    try:
        info = _ready(cmd, d / "ready.json")
        procs = cmd.tree()
        yield info
    finally:
        kill_all(cmd, procs)


@pytest.fixture(scope="module")
def reader(anchor):
    disc = Discovery.start(initial_peers=anchor["maddrs"][:1], client_mode=True)
    try:
        yield disc
    finally:
        disc.shutdown(withdraw=False)


def _holders(reader: Discovery, run: str) -> set[str]:
    return {a.peer_id for anns in reader.list_holders(run).values() for a in anns}


def _start_node(kind: str, anchor: dict, d: Path, *, tty: bool = False,
                data: Path = TEST_CORPUS) -> tuple[Command, str]:
    """``seed`` a run of its own on the anchor's DHT, or ``join`` the anchor's run (block 1)."""
    if kind == "seed":
        run = f"lc-{d.name[-20:].replace('_', '-').strip('-')}"
        args = ["seed", "--run-id", run, *SETS, "--block", "0"]
    else:
        run = ANCHOR_RUN
        args = ["join", "--run", ANCHOR_RUN, "--block", "1"]
    args += ["--initial-peers", anchor["maddrs"][0], *NODE_ARGS, "--checkpoint-dir", str(d / "ckpt"),
             "--ready-file", str(d / "ready.json")]
    args[args.index("--data") + 1] = str(data)
    if not tty:
        args.append("--quiet")
    return Command(args, d / "log", tty=tty), run


NODE_CASES = {   # case -> (command, how the stop is asked for)
    "ctrl-c-on-terminal": ("seed", "tty"),
    "SIGINT-pid": ("join", (signal.SIGINT, False)),
    "SIGINT-group": ("seed", (signal.SIGINT, True)),
    "SIGTERM-pid": ("join", (signal.SIGTERM, False)),
    "SIGTERM-group": ("join", (signal.SIGTERM, True)),
}
# cases that take the same path as another one (a terminal's Ctrl-C is SIGINT to the group): run with
# BT_FULL_MATRIX=1 (tests/conftest.py), kept out of the default run to keep CI fast
NODE_FULL_ONLY = {"SIGINT-group"}


def _ask_to_stop(cmd: Command, how) -> None:
    if how == "tty":
        cmd.ctrl_c()
    else:
        sig, group = how
        cmd.send(sig, group=group)


@contextlib.contextmanager
def _running_node(kind: str, anchor: dict, d: Path, *, tty: bool = False, data: Path = TEST_CORPUS):
    """A started node: (command, run id, ready info, every process it grew); all killed at the end."""
    cmd, run = _start_node(kind, anchor, d, tty=tty, data=data)
    procs: list = []
    try:
        info = _ready(cmd, d / "ready.json")
        procs.extend(cmd.tree())
        yield cmd, run, info, procs
    finally:
        kill_all(cmd, procs)


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.full_matrix] if c in NODE_FULL_ONLY else [])
                                  for c in NODE_CASES])
def test_node_leaves_on_signal(case, anchor, reader, tmp_path):
    kind, how = NODE_CASES[case]
    with _running_node(kind, anchor, tmp_path, tty=how == "tty") as (cmd, run, info, procs):
        port = info["http_port"]
        assert port and _status(port)["self"]["http_port"] == port   # --http-port 0: the bound port, reported
        step = wait_for(lambda: _status(port)["self"]["step"] >= 2 and _status(port)["self"]["step"], 60,
                        "a few training steps")
        wait_for(lambda: info["peer_id"] in _holders(reader, run), 30, "the node's announcement")
        procs.extend(p for p in cmd.tree() if p.pid not in {q.pid for q in procs})
        names = [p.name() for p in procs]
        # the node and its p2pd (hivemind's DHT and averager loops are threads of the node: p2p/inprocess.py)
        assert names.count("p2pd") == 1 and len(procs) >= 2, describe(procs)
        ckpt = tmp_path / "ckpt" / block_filename(info["block"])
        assert not ckpt.exists()   # --checkpoint-every 1000000: only the final checkpoint writes it

        t0 = time.monotonic()
        _ask_to_stop(cmd, how)
        rc = cmd.wait(30)
        took = time.monotonic() - t0
        withdrawn = wait_for(lambda: info["peer_id"] not in _holders(reader, run), 5, "the announcement withdrawn")
        left = wait_gone(procs, EXIT_BOUND_S)
        out = cmd.output()
        stop_line = next((ln for ln in out.splitlines() if "left the run in" in ln), "")
        report("node_signal", case=case, rc=rc, exit_s=round(took, 2), processes=len(procs), left=len(left),
               stop_line=stop_line)
        assert rc == 0, out[-3000:]
        assert took < EXIT_BOUND_S
        assert withdrawn
        assert load_block(ckpt).step >= step
        assert not left, describe(left)
        assert stop_line and "problems" not in stop_line   # every child stopped when asked, in order


def test_second_signal_exits_at_once(anchor, tmp_path):
    with _running_node("join", anchor, tmp_path) as (cmd, _, _, procs):
        t0 = time.monotonic()
        cmd.send(signal.SIGINT, group=False)
        # the second signal once the first was handled: two SIGINTs that both arrive before Python's
        # handler runs are one signal to it (a busy machine can keep the main thread waiting that long)
        deadline = time.monotonic() + 30
        while "SIGINT: stopping" not in cmd.output() and cmd.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        cmd.send(signal.SIGINT, group=False)
        rc = cmd.wait(30)
        took = time.monotonic() - t0
        left = wait_gone(procs, EXIT_BOUND_S)
        report("node_second_signal", rc=rc, exit_s=round(took, 2), left=len(left))
        assert rc == 128 + signal.SIGINT, cmd.output()[-3000:]
        assert "left the run in" not in cmd.output()   # it did not wait for the graceful stop
        assert not left, describe(left)


def test_sigkilled_node_leaves_no_process(anchor, tmp_path):
    with _running_node("join", anchor, tmp_path) as (cmd, _, _, procs):
        cmd.send(signal.SIGKILL, group=False)   # the main process only: its children must go on their own
        assert cmd.wait(10) == -signal.SIGKILL
        left = wait_gone(procs, EXIT_BOUND_S)
        report("node_sigkill", processes=len(procs), left=len(left))
        assert not left, describe(left)


def test_hivemind_children_outlive_group_signals(tmp_path):
    """A Ctrl-C or ``kill -- -PGID`` reaches every process of the group at once: the DHT process and
    p2pd must still be there and answering, so the node (here a plain Discovery holder that shrugs
    the signals off) can still withdraw its records and stop them in order."""
    probe = JsonLinesProc("probe", [sys.executable, str(Path(__file__).parent / "test_utils" / "dht_probe.py")],
                          tmp_path / "probe.log")
    procs = []
    try:
        assert probe._ready(120).get("event") == "ready"
        procs = [psutil.Process(probe.proc.pid), *psutil.Process(probe.proc.pid).children(recursive=True)]
        assert "p2pd" in [p.name() for p in procs], describe(procs)
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.killpg(probe.proc.pid, sig)
        time.sleep(3)   # p2pd, left to itself, is gone within a second of a SIGINT
        probe.send("check")
        res = probe._next(30)["result"]
        dead = [p for p in procs if p not in running(procs)]
        report("group_signals_children", answers=res["answers"], dead=describe(dead), signals=res["signals"])
        assert not dead, describe(dead)
        assert res["answers"], res["error"]
        assert sorted(res["signals"]) == [signal.SIGINT, signal.SIGTERM]   # the signals did arrive
        probe.send("quit")
        assert probe.wait(30) == 0
        assert not wait_gone(procs, EXIT_BOUND_S)
    finally:
        probe.stop(timeout=1)
        kill_all_procs(procs)


# -- bt-node swarm ------------------------------------------------------------------------------
SWARM_ARGS = ["swarm", "--nodes", "2", "--budget", "2s", "--data", str(TEST_CORPUS), "--gen-bytes", "8",
              *[x for kv in [*TINY, "n_blocks=2"] for x in ("--set", kv)]]
KEPT = "network kept running"
SWARM_CASES = {
    "ctrl-c-on-terminal": "tty",
    "SIGINT-pid": (signal.SIGINT, False),
    "SIGINT-group": (signal.SIGINT, True),
    "SIGTERM-pid": (signal.SIGTERM, False),
    "SIGTERM-group": (signal.SIGTERM, True),
}
# by default: Ctrl-C on the terminal (SIGINT to every process of the group) and SIGTERM to the
# swarm's pid alone (it must pass the stop on); the rest with BT_FULL_MATRIX=1
SWARM_FULL_ONLY = {"SIGINT-pid", "SIGINT-group", "SIGTERM-group"}


@contextlib.contextmanager
def _running_swarm(tmp_path: Path, *, tty: bool):
    """``bt-node swarm --keep-running``, serving: (command, every process it grew); all killed at the end."""
    cmd = Command([*SWARM_ARGS, "--keep-running", "--workdir", str(tmp_path / "swarm")], tmp_path / "log", tty=tty,
                  env={"BT_TRAIN_DUTY": QUIET_TRAINING[1]})   # the swarm's nodes read it (--train-duty)
    procs: list = []
    try:
        cmd.wait_output(KEPT, 240)
        procs.extend(cmd.tree())
        yield cmd, procs
    finally:
        kill_all(cmd, procs)


def _node_dirs(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "swarm").glob("node*") if p.is_dir())


def _stop_line(log: Path) -> str:
    return next((ln for ln in log.read_text().splitlines() if "left the run in" in ln), "")


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.full_matrix] if c in SWARM_FULL_ONLY else [])
                                  for c in SWARM_CASES])
def test_swarm_stops_everything_on_signal(case, tmp_path):
    how = SWARM_CASES[case]
    with _running_swarm(tmp_path, tty=how == "tty") as (cmd, procs):
        steps = {}
        for d in _node_dirs(tmp_path):
            info = json.loads((d / "ready.json").read_text())
            steps[d] = (info["block"], _status(info["http_port"])["self"]["step"])
        procs.extend(p for p in cmd.tree() if p.pid not in {q.pid for q in procs})
        assert sum(p.name() == "p2pd" for p in procs) == 2 and len(procs) >= 5, describe(procs)   # swarm + 2 x (node, p2pd)

        t0 = time.monotonic()
        _ask_to_stop(cmd, how)
        rc = cmd.wait(30)
        took = time.monotonic() - t0
        left = wait_gone(procs, EXIT_BOUND_S)
        report("swarm_signal", case=case, rc=rc, exit_s=round(took, 2), processes=len(procs), left=len(left),
               stop_lines=[_stop_line(d / "node.log") for d in steps])
        assert rc == 0, cmd.output()[-3000:]
        assert took < EXIT_BOUND_S
        for d, (block, step) in steps.items():   # every node left gracefully: its final checkpoint is where it was
            assert load_block(d / "ckpt" / block_filename(block)).step >= step
            line = _stop_line(d / "node.log")
            assert line and "problems" not in line
        assert not left, describe(left)


@pytest.mark.slow
def test_sigkilled_swarm_leaves_no_process(tmp_path):
    with _running_swarm(tmp_path, tty=False) as (cmd, procs):
        cmd.send(signal.SIGKILL, group=False)
        assert cmd.wait(10) == -signal.SIGKILL
        left = wait_gone(procs, EXIT_BOUND_S)
        report("swarm_sigkill", processes=len(procs), left=len(left),
               stop_lines=[_stop_line(d / "node.log") for d in _node_dirs(tmp_path)])
        assert not left, describe(left)
        for d in _node_dirs(tmp_path):   # the parent-death signal made each node leave gracefully
            assert _stop_line(d / "node.log")


# bench pipeline's reference model trains in a spawned child (bench/pipeline_refs.py): multiprocessing stops it
# only when the bench exits normally, so a SIGKILLed bench left it training for its whole budget
REF_PROGRAM = """
import sys, torch
from blocktrain.bench.pipeline_refs import train_reference
from blocktrain.blocks.config import ModelConfig
from blocktrain.node.swarm.run import typed_settings
cfg = ModelConfig.from_dict(typed_settings(sys.argv[2:]), source="test")
train_reference(cfg.to_dict(), sys.argv[1], 1, torch.zeros(2, cfg.seq_len + 1, dtype=torch.long), seconds=600)
"""


@pytest.mark.slow   # a spawned child importing torch and training 3 CPU-s: 44 s at load 10 on 2 cores
def test_sigkilled_bench_leaves_no_reference_process(tmp_path):
    parent = psutil.Popen([sys.executable, "-c", REF_PROGRAM, str(TEST_CORPUS), *TINY],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    procs = [parent]
    try:
        def trainer():   # the spawned child, once it is past its imports and training (CPU-s spent)
            kids = [p for p in parent.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
            return kids[0] if kids and sum(kids[0].cpu_times()[:2]) > 3 else None
        wait_for(lambda: trainer() is not None or parent.poll() is not None, 180, "the reference child training")
        assert parent.poll() is None
        procs += parent.children(recursive=True)
        parent.kill()
        parent.wait(10)
        left = wait_gone(procs, EXIT_BOUND_S)
        assert not left, describe(left)
    finally:
        kill_all_procs(procs)


def test_joiner_is_announced_joining_while_it_downloads_then_online(anchor, reader):
    """``Node._join_announced`` (node/node.py) on a real DHT (the anchor's): while the late join runs,
    the node's record is visible as ``joining`` (other joiners' ``choose_block`` counts it, routers and
    the rebalancing rule's ready counts do not); afterwards ``online``; the teardown withdraws it.
    Only the late join itself is replaced (by the check), so the test needs no second node process."""
    from types import SimpleNamespace

    from blocktrain.node.loops import Teardown
    from blocktrain.node.node import Node
    from blocktrain.node.routing.selection import block_load, ready_load
    from blocktrain.p2p.records import BlockAnnouncement

    cfg_hash = reader.get_manifest(ANCHOR_RUN).config_hash
    disc = Discovery.start(initial_peers=anchor["maddrs"][:1], run_ids=[ANCHOR_RUN])
    ns = SimpleNamespace(discovery=disc, teardown=Teardown(), state="starting")
    ns.announcements = lambda: [BlockAnnouncement(
        peer_id=disc.peer_id, block_index=1, state=ns.state, step=0, samples_seen=0, throughput=0.0, serving=True,
        software_version="test", config_hash=cfg_hash, run_id=ANCHOR_RUN)]

    def mine() -> list:
        return [a for a in reader.list_holders(ANCHOR_RUN).get(1, []) if a.peer_id == disc.peer_id]

    seen = {}

    def late_join() -> None:   # what others see while this node downloads
        seen["during"] = wait_for(lambda: [a.state for a in mine()], 30, "the joining record")
        holders = reader.list_holders(ANCHOR_RUN)
        others = {b: [a for a in anns if a.peer_id != disc.peer_id] for b, anns in holders.items()}
        seen["counted"] = [f(h, 2)[1] for f in (lambda h, n: block_load(h, n)[0], ready_load) for h in (holders, others)]

    ns._late_join = late_join
    try:
        Node._join_announced(ns)
        assert seen["during"] == ["joining"]
        live, live_others, ready, ready_others = seen["counted"]
        assert live == live_others + 1 and ready == ready_others   # counted by joiners, not as ready
        assert ns.state == "online"
        assert wait_for(lambda: [a.state for a in mine()] == ["online"], 30, "the online record")
        ns.teardown.close(deadline=10)
        assert wait_for(lambda: not mine(), 10, "the record withdrawn")
    finally:
        ns.teardown.close(deadline=10)
        disc.shutdown(withdraw=False)


FAULTY = Path(__file__).parent / "test_utils" / "faulty_node.py"


def test_a_slow_training_step_still_ends_in_a_final_checkpoint(anchor, tmp_path):
    """A block whose training step takes longer than the stop's usual budgets (12 s here, as a big
    block's step on a slow machine; the train loop gets 3 s and the final checkpoint 4 s) still leaves
    its final checkpoint on SIGTERM: the stop waits for the step in progress, then saves. (It used to
    abandon the checkpoint after 4 s: a node with a big block lost everything since its last periodic
    checkpoint on every graceful stop.)"""
    args = ["seed", "--run-id", "lc-slow", *SETS, "--block", "0", "--initial-peers", anchor["maddrs"][0],
            "--data", str(TEST_CORPUS), "--http-port", "0", "--checkpoint-every", "1000000", "--device", "cpu",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--ready-file", str(tmp_path / "ready.json"), "--quiet"]
    cmd = Command(["slow_step", *args], tmp_path / "log", prog=[sys.executable, str(FAULTY)])
    procs: list = []
    try:
        info = _ready(cmd, tmp_path / "ready.json")
        procs.extend(cmd.tree())
        port = info["http_port"]
        step = wait_for(lambda: _status(port)["self"]["step"] >= 2 and _status(port)["self"]["step"], 120,
                        "a slow training step done (the next one then under way)")
        t0 = time.monotonic()
        cmd.send(signal.SIGTERM, group=False)
        rc = cmd.wait(90)
        took = time.monotonic() - t0
        out = cmd.output()
        stop_line = next((ln for ln in out.splitlines() if "left the run in" in ln), "")
        report("node_slow_step_stop", rc=rc, exit_s=round(took, 2), stop_line=stop_line)
        assert rc == 0, out[-3000:]
        ckpt = tmp_path / "ckpt" / block_filename(info["block"])
        assert ckpt.exists(), out[-3000:]
        assert load_block(ckpt).step >= step
        assert stop_line and "problems" not in stop_line, stop_line   # nothing abandoned
        assert took < 60, took   # one slow step and a save, not the launcher's last resort
        assert not wait_gone(procs, EXIT_BOUND_S), describe(procs)
    finally:
        kill_all(cmd, procs)


def test_a_training_file_changed_under_a_node_stops_it_with_the_reason_and_its_checkpoint(anchor, tmp_path):
    """A node reads its training windows from the file as it draws them (it holds none of its corpus in
    memory); a file truncated under it must not feed it other bytes, nor crash it: its train loop stops
    with the file named, the node leaves (exit 1, the reason printed) with its final checkpoint written
    and nothing left running."""
    import shutil
    data = tmp_path / "data"
    shutil.copytree(TEST_CORPUS, data)
    with _running_node("seed", anchor, tmp_path, data=data) as (cmd, _run, info, procs):
        port = info["http_port"]
        step = wait_for(lambda: _status(port)["self"]["step"] >= 2 and _status(port)["self"]["step"], 120,
                        "two training steps")
        with open(data / "train.txt", "r+b") as f:
            f.truncate(1000)
        rc = cmd.wait(90)
        out = cmd.output()
        report("node_data_changed_stop", rc=rc, tail=out.strip().splitlines()[-1:])
        assert rc == 1, out[-3000:]
        assert "train.txt: the file changed after it was opened" in out, out[-3000:]
        ckpt = tmp_path / "ckpt" / block_filename(info["block"])
        assert ckpt.exists() and load_block(ckpt).step >= step, out[-3000:]
        assert not wait_gone(procs, EXIT_BOUND_S), describe(procs)
