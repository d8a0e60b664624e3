"""Network CLI commands: the swarm JSON contract, and clear one-line errors for bad input."""
from __future__ import annotations

import json
import math
import shlex
import subprocess

import pytest

from blocktrain.node.swarm.launcher import LocalSwarm, NodeProc
from blocktrain.node.swarm.run import SWARM_DEFAULTS, plan_blocks

from test_utils.configs import TEST_CORPUS, TEST_CORPUS_PROTOCOL
from test_utils.zygote import run_cli

TINY_SETS = [x for kv in SWARM_DEFAULTS + ["n_blocks=2"] for x in ("--set", kv)]


def bt(*args, timeout=300):
    return run_cli(list(args), timeout=timeout)


def one_line_error(r, *needles):
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("Error:"), err
    for n in needles:
        assert n in err, (n, err)


def test_plan_blocks_covers_every_block_then_replicates():
    assert plan_blocks(5, 4) == [0, 1, 2, 3, 1]
    assert plan_blocks(6, 4) == [0, 1, 2, 3, 1, 2]
    with pytest.raises(ValueError):
        plan_blocks(3, 4)


@pytest.mark.network
@pytest.mark.slow
def test_swarm_command_json_contract(tmp_path):
    """The whole network path (training, averaging, chain scoring through hops, generation) behind
    one command, for the default objective (the others: test_node_objectives.py)."""
    data = TEST_CORPUS
    r = bt("swarm", "--nodes", "3", "--budget", "10s", "--data", str(data), "--set", "n_blocks=2",
           "--workdir", str(tmp_path / "sw"), "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    for key in ("chain_ce", "ce_kind", "averaging_rounds", "generated", "route", "nodes", "seconds", "protocol"):
        assert key in res, key
    assert res["objective"] == "pipeline"   # the default of a new run (issue 13, target 5)
    assert res["ce_kind"] == "exact" and res["protocol"] == TEST_CORPUS_PROTOCOL
    assert res["chain_ce"] < math.log(256)
    assert len(res["nodes"]) == 3 and [h["block"] for h in res["route"]] == [0, 1]
    assert len(res["generated"]) > 0
    assert res["averaging_rounds"] >= 1   # block 1 is held twice
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path / "sw")], capture_output=True, text=True).stdout
    assert leftovers.strip() == "", f"processes left behind: {leftovers}"


def test_bad_network_flags_are_usage_errors():
    r = bt("join")
    assert r.returncode == 2 and "--initial-peers" in r.stderr
    r = bt("join", "--initial-peers", "not-a-multiaddr")
    one_line_error(r, "not-a-multiaddr")
    r = bt("generate", "hi")
    assert r.returncode == 2 and "exactly one of" in r.stderr
    r = bt("seed", "--run-id", "bad.id", "--set", "n_blocks=2")
    one_line_error(r, "run id")
    r = bt("generate", "hi", "--http", "http://127.0.0.1:9")
    one_line_error(r, "cannot reach")


@pytest.mark.network
def test_unreachable_peer_gives_one_line_error(tmp_path):
    r = bt("join", "--initial-peers", "/ip4/127.0.0.1/tcp/9/p2p/QmSDpxpQWKH63Xpf7SKw8tvFw4JH2yzKucxC7KWNBHzby5",
           "--checkpoint-dir", str(tmp_path / "ckpt"), timeout=180)
    one_line_error(r)


@pytest.mark.network
@pytest.mark.slow
def test_missing_run_and_config_mismatch_are_refused(tmp_path):
    data = TEST_CORPUS
    sw = LocalSwarm(tmp_path / "one", run_id="errtest", overrides=SWARM_DEFAULTS + ["n_blocks=2"], data=str(data))
    try:
        sw.start_seed(block=0, args=["--max-steps", "5"])
        r = bt("join", "--initial-peers", sw.seed_maddr, "--run-id", "nosuchrun",
               "--checkpoint-dir", str(tmp_path / "j1"), timeout=180)
        one_line_error(r, "nosuchrun")
        r = bt("seed", "--run-id", "errtest", "--initial-peers", sw.seed_maddr, *TINY_SETS, "--set", "d_model=48",
               "--checkpoint-dir", str(tmp_path / "j2"), timeout=180)
        one_line_error(r, "errtest")
        # a new run's seed with a --block its config does not have: refused before its manifest is
        # published (else a run that never trained would be readable, and its run id claimed, for the manifest's TTL)
        r = bt("seed", "--run-id", "typo", "--initial-peers", sw.seed_maddr, *TINY_SETS, "--block", "2",
               "--checkpoint-dir", str(tmp_path / "j3"), timeout=180)
        one_line_error(r, "--block 2 is out of range", "2 blocks")
        one_line_error(bt("status", "--initial-peers", sw.seed_maddr, "--run-id", "typo", timeout=180), "typo")
        # no --run-id: the signed run index in the DHT names the only live run
        r = bt("status", "--initial-peers", sw.seed_maddr, "--json", timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        st = json.loads(r.stdout)
        assert st["run"]["run_id"] == "errtest" and len(st["blocks"]) == 2
        assert st["blocks"][0]["holders"] and not st["blocks"][1]["holders"]
    finally:
        sw.stop_all()


def _join_line(node: NodeProc) -> list[str]:
    """The command a node prints for others to join through it (one line, unbroken, even in a log file)."""
    lines = node.log_file.read_text().splitlines()
    i = lines.index("Others join with:")
    argv = shlex.split(lines[i + 1])
    assert argv[:2] == ["bt-node", "join"], lines[i + 1]
    return argv[1:]


def test_every_nodes_join_line_joins_the_run(tmp_path):
    """The seeder's line and a member's line both join the seeder's run (a member's used to pin the member
    itself as the seeder: ``no manifest of run ... by seeder <member>``)."""
    sw = LocalSwarm(tmp_path / "net", run_id="joinline", overrides=SWARM_DEFAULTS + ["n_blocks=2", "objective=paper"],
                    data=str(TEST_CORPUS))
    try:
        seed = sw.start_seed(block=0, args=["--max-steps", "1"])   # joining, not training, is under test
        member = sw.start_join(block=1, args=["--max-steps", "1"])
        for name, via in (("via-seed", seed), ("via-member", member)):
            n = NodeProc(name, [*_join_line(via), "--data", str(TEST_CORPUS), "--max-steps", "1"], tmp_path / name)
            sw.nodes.append(n)
            n.start()
            info = n.wait_ready()
            assert info["run_address"] == seed.wait_ready()["run_address"], (name, info)
    finally:
        sw.stop_all()


def test_export_then_generate_and_load_offline(tmp_path):
    """The end user's path out of the network (README): ``bt-node export`` pulls every block of a live run into
    one directory, which ``bt-node generate --checkpoint`` and ``blocktrain.blocks.load`` then run with no
    network. The exported weights are the holders' (byte for byte the tensors they serve)."""
    import torch
    from safetensors.torch import load_file

    from blocktrain.blocks import load
    from test_utils.reliability import wait_for

    sw = LocalSwarm(tmp_path / "net", run_id="exp", overrides=SWARM_DEFAULTS + ["n_blocks=2"], data=str(TEST_CORPUS))
    try:
        nodes = [sw.start_seed(block=0, args=["--max-steps", "3"]), sw.start_join(block=1, args=["--max-steps", "3"])]
        wait_for(lambda: all(n.get("/v1/status")["self"]["step"] >= 3 for n in nodes), 120, "3 steps on each block")
        out = tmp_path / "exported"
        r = bt("export", "--initial-peers", sw.seed_maddr, "--out", str(out), "--json", timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        res = json.loads(r.stdout)
        assert res["run_id"] == "exp" and len(res["blocks"]) == 2
        assert sorted(p.name for p in out.iterdir()) == ["block00.safetensors", "block01.safetensors", "config.json"]
    finally:
        sw.stop_all()
    for b, n in enumerate(nodes):   # training had stopped (--max-steps): what each holder saved at its stop
        mine, got = load_file(n.workdir / "ckpt" / f"block{b:02d}.safetensors"), load_file(out / f"block{b:02d}.safetensors")
        assert mine.keys() == got.keys() and all(torch.equal(mine[k], got[k]) for k in mine), b
    r = bt("generate", "The history of", "--checkpoint", str(out), "--max-bytes", "8", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("The history of") and len(r.stdout.rstrip("\n")) > len("The history of"), r.stdout
    model = load(out)
    assert math.isfinite(model.score("The history of the world is long."))
    text = model.generate("The history of", max_bytes=8)["text"]   # the continuation alone
    assert isinstance(text, str) and 0 < len(text) <= 8, text


def test_a_new_run_trains_pipeline_unless_its_seeder_names_an_objective(tmp_path):
    """Issue 13, target 5: `seed` and `swarm` start `pipeline` runs by default; `paper` (or any
    objective) is one flag away, and a config file that names one is obeyed. Offline commands and
    the library launcher keep the config's default."""
    from click.testing import CliRunner

    from blocktrain.blocks.config import ModelConfig
    from blocktrain.cli.config_opts import build_config
    from blocktrain.cli.main import cli
    from blocktrain.node.options import NEW_RUN_OBJECTIVE

    assert NEW_RUN_OBJECTIVE == "pipeline" and ModelConfig().objective == "paper"
    named = tmp_path / "named.toml"
    named.write_text('objective = "forward-chained"\nn_blocks = 2\n')
    nested = tmp_path / "nested.toml"
    nested.write_text('[model]\nobjective = "paper"\n')
    silent = tmp_path / "silent.json"
    silent.write_text('{"n_blocks": 2}')
    d = NEW_RUN_OBJECTIVE
    assert build_config(None, None, (), default_objective=d).objective == "pipeline"
    assert build_config(None, "paper", (), default_objective=d).objective == "paper"
    assert build_config(None, None, ("objective=paper",), default_objective=d).objective == "paper"
    assert build_config(None, None, (" objective =paper",), default_objective=d).objective == "paper"
    assert build_config(str(named), None, (), default_objective=d).objective == "forward-chained"
    assert build_config(str(nested), None, (), default_objective=d).objective == "paper"
    assert build_config(str(silent), None, (), default_objective=d).objective == "pipeline"
    assert build_config(None, None, ()).objective == "paper"          # train-local, bench quality: the config's
    for cmd, needle in (("seed", "default: pipeline"), ("swarm", "objective: pipeline")):
        out = CliRunner().invoke(cli, [cmd, "--help"]).output
        assert needle in " ".join(out.split()), out
    # the launcher names the config's objective to its seed (its overrides may name another)
    assert LocalSwarm(tmp_path / "a").overrides[0] == "objective=paper"
    assert LocalSwarm(tmp_path / "b", overrides=["objective=pipeline"]).overrides == ["objective=pipeline"]
