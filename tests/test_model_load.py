"""The model outside the network: ``blocktrain.blocks.load(DIR)`` on a directory written by
``train-local --out``, ``bt-node generate --checkpoint DIR``, and clear errors for bad directories."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks import load
from blocktrain.blocks.data import DataSplit
from blocktrain.blocks.local_run import LocalRun
from blocktrain.blocks.windows import text_windows
from blocktrain.cli.main import cli

from test_utils.configs import tiny_config

TEXT = b"the cat sat on the mat; the dog sat on the log. " * 60
PROMPT = "the cat "


@pytest.fixture(scope="module", params=["paper", "chunked-masked"])
def trained(request, tmp_path_factory):
    """A tiny run trained for a few rounds and saved as train-local --out saves it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # tiny tensors: see conftest's one_thread
    extra = {"chunk_len": 4} if request.param == "chunked-masked" else {}
    cfg = tiny_config(n_blocks=2, objective=request.param, lr=3e-3, **extra)
    data = np.frombuffer(TEXT, dtype=np.uint8)
    run = LocalRun(cfg, DataSplit(data, data, "test", "in-memory"), torch.device("cpu"), reference=False)
    for _ in range(5):
        run.round()
    out = tmp_path_factory.mktemp("ck") / request.param
    run.save(out)
    yield run, out
    torch.set_num_threads(threads)


def test_load_round_trip_generates_and_scores_as_the_trained_blocks(trained):
    run, out = trained
    model = load(out, device="cpu")
    assert model.cfg.config_hash == run.cfg.config_hash and len(model.blocks) == run.cfg.n_blocks
    hops = run.objective.local_hops(run.blocks)
    for mode, gen in (("one_sweep", run.objective.generate_one_sweep),
                      ("autoregressive", run.objective.generate_autoregressive)):
        for temperature in (0.0, 1.0):
            g = torch.Generator().manual_seed(4)
            want = gen(hops, PROMPT.encode(), 9, temperature=temperature, generator=g)
            res = model.generate(PROMPT, max_bytes=9, mode=mode, temperature=temperature, seed=4)
            assert res["bytes"] == want and res["bytes_generated"] == 9 and res["mode"] == mode
            assert res["text"] == want.decode("utf-8", errors="replace")
            assert res["route"] == [{"block": b, "peer": "local"} for b in range(run.cfg.n_blocks)]
    assert model.generate(PROMPT.encode(), max_bytes=8, mode="one_sweep")["traversals"] == \
        (1 if run.cfg.objective == "paper" else 2)                       # chunked-masked: one per chunk of 4
    assert model.generate(PROMPT, max_bytes=5, mode="autoregressive")["traversals"] == 5
    text = TEXT[:300]
    want = run.objective.score(hops, text_windows(text, run.cfg.seq_len), k=2,
                               generator=torch.Generator().manual_seed(0)).ce
    assert model.score(text) == want and model.score(text.decode()) == want
    assert 0 < want < np.log(256) + 0.1 and model.ce_kind == run.objective.ce_kind
    with pytest.raises(ValueError, match="unknown mode"):
        model.generate(PROMPT, mode="sideways")
    with pytest.raises(ValueError, match="at least 2 bytes"):
        model.score("x")


def test_generate_checkpoint_prints_text_and_a_local_route(trained):
    run, out = trained
    r = CliRunner().invoke(cli, ["generate", PROMPT, "--checkpoint", str(out), "--max-bytes", "8"])
    assert r.exit_code == 0, r.output
    want = load(out, device="cpu").generate(PROMPT, max_bytes=8)["text"]
    assert r.stdout == PROMPT + want + "\n"
    route = " -> ".join(f"b{b}@local" for b in range(run.cfg.n_blocks))
    assert f"route: {route}; mode one_sweep; traversals" in r.stderr
    r = CliRunner().invoke(cli, ["generate", PROMPT, "--checkpoint", str(out), "--max-bytes", "3", "--json",
                                 "--mode", "autoregressive"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert {"text", "bytes_generated", "mode", "route", "traversals", "latency_ms", "checkpoint"} <= set(res)
    assert res["mode"] == "autoregressive" and res["traversals"] == 3 and res["checkpoint"] == str(out)


def test_bad_checkpoint_directories_give_one_clear_line(tmp_path, trained):
    run, out = trained

    def gen(*args):
        return CliRunner().invoke(cli, ["generate", "hi", *args])

    r = gen("--checkpoint", str(tmp_path / "missing"))
    assert r.exit_code == 1 and "missing" in r.stderr and "not found" in r.stderr and "Traceback" not in r.output
    (tmp_path / "empty").mkdir()
    r = gen("--checkpoint", str(tmp_path / "empty"))
    assert r.exit_code == 1 and "no config.json and no block files" in r.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    ckpt.save_config(broken, run.cfg)
    (broken / ckpt.block_filename(0)).write_bytes(b"not safetensors")
    r = gen("--checkpoint", str(broken))
    assert r.exit_code == 1 and "block00.safetensors" in r.stderr and "Traceback" not in r.output
    # blocks of another objective under this config: names the file and the mismatch
    other = tiny_config(n_blocks=2, objective="forward-chained" if run.cfg.objective == "paper" else "paper")
    wrong = tmp_path / "wrong"
    for b, m in enumerate(run.blocks):
        ckpt.save_block(wrong / ckpt.block_filename(b), m.state_dict(), config=other, block_index=b, step=1,
                        samples_seen=1)
    r = gen("--checkpoint", str(wrong))
    assert r.exit_code == 1 and f"not a {other.objective} block 0" in r.stderr
    with pytest.raises(ckpt.CheckpointError, match="not found"):
        load(tmp_path / "missing")
    r = gen("--checkpoint", str(out), "--http", "http://127.0.0.1:9")
    assert r.exit_code == 2
    assert "exactly one of --checkpoint DIR, --initial-peers MULTIADDR (or --run RUN@MULTIADDR) or --http URL" in r.stderr


BLOCKED = ("hivemind", "fastapi", "httpx", "uvicorn", "pydantic", "multiaddr",
           "blocktrain.node", "blocktrain.p2p", "blocktrain.cli", "blocktrain.bench")


def test_blocks_run_without_network_code(trained):
    """Every module of blocktrain.blocks imports, and a checkpoint loads and generates, with the network
    stack and the rest of BlockTrain made unimportable (a GPU box without hivemind)."""
    _, out = trained
    script = f"""
import importlib, importlib.abc, pkgutil, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in {BLOCKED!r}):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import blocktrain.blocks as blocks
for m in pkgutil.walk_packages(blocks.__path__, "blocktrain.blocks."):
    importlib.import_module(m.name)
res = blocks.load({str(out)!r}, device="cpu").generate("the ", max_bytes=4)
assert res["bytes_generated"] == 4, res
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
