"""The pipeline engine against the single-process reference, on real node processes: four
``bt-node`` processes hold one block each of a ``pipeline`` run (and, parametrized, of a
``pipeline-chunked`` run: the engine carries any differentiable chain, here one whose state packs two
streams, D = 2 d_model; and a ``pipeline`` run whose holders keep inputs, not graphs, and run each
forward again before its backward: ``--pipeline-recompute``, and with it ``--pipeline-layer-checkpoint``: every
forward that records a graph keeps only each layer's input and the backward runs each layer again); block 0's holder sends one fixed
micro-batch through the chain in fp32 and then the same one in fp16 (each node's engine records,
test side, its gradients: ``test_utils/pipeline_probe.py``). The comparison needs each micro-batch delivered exactly
once: a swarm where one was resent (a cut answer stream, or one lost after it went out) is probed once more afresh
(``probed``).

* fp32: the activation gradient each stage answers (dL/dh_b at every boundary) and every block's
  parameter gradients equal ``blocks.chain_train.chain_gradients`` on the same weights and batch,
  to float tolerance; fp16: the same within half-precision error;
* the bytes each worker counts for activations, gradients and targets are exactly the tensors'
  sizes (4 N T D per fp32 tensor, 2 N T D per fp16 one, N T target bytes);
* bad activation messages sent by a raw client (wrong shape, NaN, wrong dtype, missing tensor)
  get a typed error, the node lives on, and a good message afterwards is answered.
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from hivemind.p2p import P2P

from blocktrain.blocks.chain_train import chain_gradients
from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.objectives import get_objective
from blocktrain.node.swarm.launcher import NodeProc
from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.hops import decode_meta
from blocktrain.p2p.pipeline_wire import StageRequest, request_message
from blocktrain.p2p.tensors import encode_tensor

from test_utils.configs import TEST_CORPUS
from test_utils.raw_pipeline import raw_train_call
from test_utils.reliability import HERE, stop_swarm, wait_for

pytestmark = [pytest.mark.network, pytest.mark.slow, pytest.mark.timeout(420)]

SETS = {"n_blocks": 4, "d_model": 32, "n_heads": 2, "layers_per_block": 1, "seq_len": 16,
        "target_dim": 16, "batch_size": 2, "warmup_steps": 0, "chunk_len": 4}
N, T = 2, 16


class _Swarm:   # what stop_swarm needs
    def __init__(self, base, nodes):
        self.base, self.nodes = base, nodes


@dataclass
class Probed:
    base: Path
    nodes: dict[int, NodeProc]      # by block
    windows: torch.Tensor
    objective: str
    run: str
    d: int                          # the state's last axis (the objective's state_dim)
    recompute: bool = False         # the holders run with --pipeline-recompute
    layer_checkpoint: bool = False  # and with --pipeline-layer-checkpoint

    @property
    def sets(self) -> dict:
        return {**SETS, "objective": self.objective}


def _probe_swarm(sw: _Swarm, run: str, objective: str, extra: tuple[str, ...]) -> dict[int, NodeProc]:
    """Start the four probed holders in ``sw.base`` (block 0 last: its holder sends once the chain is complete)
    and wait until both micro-batches went through every stage."""
    base = sw.base
    sets = [x for k, v in {**SETS, "objective": objective}.items() for x in ("--set", f"{k}={v}")]
    common = ["--data", str(TEST_CORPUS), "--device", "cpu", "--pipeline-accumulate", "4096",
              "--average-every", "1000000", "--average-period", "1e9", "--average-clock", "0", *extra]
    for b in (3, 2, 1, 0):
        args = (["seed", "--run-id", run, *sets] if b == 3 else
                ["join", "--initial-peers", sw.nodes[0].info["maddrs"][0], "--run-id", run])
        n = NodeProc(f"b{b}", [*args, "--block", str(b), *common], base / f"b{b}", 0,   # 0: the node binds a port itself
                     entry=[sys.executable, str(HERE / "pipeline_probe.py")])
        n.env = {"BT_PROBE_DIR": str(base / f"probe{b}"), "BT_PROBE_CODECS": "fp32,fp16",
                 "BT_PROBE_WINDOWS": str(base.parent / "windows.pt")}
        sw.nodes.append(n)
        n.start(env=n.env)
        n.wait_ready(timeout=180)
    wait_for(lambda: all((base / f"probe{b}" / "grads-1.pt").exists() for b in range(4)), 180,
             "two micro-batches through every stage")
    return {b: sw.nodes[3 - b] for b in range(4)}


def _resends(by_block: dict[int, NodeProc]) -> dict[int, dict]:
    """The senders whose two micro-batches did not go out exactly once each, with what their stats say."""
    out = {}
    for b in range(3):
        pipe = by_block[b].get("/v1/status")["self"]["pipeline"]
        if pipe["traffic"]["calls_out"] != 2:
            out[b] = {k: v for k, v in {**pipe, **pipe["traffic"]}.items()
                      if (isinstance(v, (int, float)) and v and k not in ("block", "held_now")) or k == "lost_by_reason"}
    return out


@pytest.fixture(scope="module", params=[("pipeline", ()), ("pipeline-chunked", ()),
                                        ("pipeline", ("--pipeline-recompute",)),
                                        ("pipeline", ("--pipeline-recompute", "--pipeline-layer-checkpoint"))],
                ids=["pipeline", "pipeline-chunked", "pipeline-recompute", "pipeline-recompute-layer-checkpoint"])
def probed(request, tmp_path_factory):
    """The probed swarm, its two micro-batches delivered exactly once. A resent micro-batch (a cut answer stream
    is asked again of the same holder: ``retried_same``, ARCHITECTURE "Training traffic") is trained twice below
    the resend and, as the probe switches a holder's codec at its first answer, goes on in fp16: the exact
    comparison cannot be made on it (the last CI on record before this check, 2026-12-07: block 0 sent the fp32
    micro-batch twice; why was not recorded, the warning now gives the senders' counters). Such a swarm is
    stopped and the probe made once more on a fresh one; twice fails."""
    objective, extra = request.param
    run = "-".join(["pipegrad", objective, *(x.removeprefix("--pipeline-") for x in extra)])
    root = tmp_path_factory.mktemp(run)
    windows = torch.randint(0, 256, (N, T + 1), generator=torch.Generator().manual_seed(11))
    torch.save(windows, root / "windows.pt")
    swarms: list[_Swarm] = []
    try:
        for attempt in (1, 2):
            sw = _Swarm(root / f"try{attempt}", [])
            swarms.append(sw)
            by_block = _probe_swarm(sw, f"{run}-{attempt}", objective, extra)
            resent = _resends(by_block)
            if not resent:
                break
            assert attempt == 1, f"micro-batches resent again on a fresh swarm: {resent}"
            warnings.warn(f"{run}: micro-batches resent ({resent}); probing once more on a fresh swarm")
            swarms.remove(sw)
            stop_swarm(sw)
        d = get_objective(ModelConfig(**{**SETS, "objective": objective})).state_dim()
        yield Probed(sw.base, by_block, windows, objective, f"{run}-{attempt}", d,
                     recompute="--pipeline-recompute" in extra,
                     layer_checkpoint="--pipeline-layer-checkpoint" in extra)
    finally:
        for sw in swarms:
            stop_swarm(sw)


def reference(probed: Probed):
    cfg, windows = ModelConfig(**probed.sets), probed.windows
    obj = get_objective(cfg)
    blocks = [obj.build_block(b) for b in range(cfg.n_blocks)]   # the nodes' initial weights
    return blocks, chain_gradients(obj, blocks, windows)


def rel_err(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_gradients_match_the_single_process_reference(probed):
    base = probed.base
    blocks, ref = reference(probed)
    for mb, codec in enumerate(("fp32", "fp16")):
        tol = dict(rtol=1e-4, atol=1e-7) if codec == "fp32" else None
        for b in range(4):
            got = torch.load(base / f"probe{b}" / f"grads-{mb}.pt")
            want = {n: p.grad for n, p in blocks[b].named_parameters()}
            assert got.keys() == want.keys()
            for name in want:
                if tol:
                    torch.testing.assert_close(got[name], want[name], **tol, msg=f"block {b} {name}")
                else:
                    assert rel_err(got[name], want[name]) < 2e-2, (b, name, rel_err(got[name], want[name]))
            if b == 0:
                continue
            answer = torch.load(base / f"probe{b}" / f"answer-{mb}.pt")   # dL/dh_{b-1}, what stage b sent back
            assert answer["codec"] == codec and answer["loss"] == pytest.approx(ref.losses[3], abs=2e-3)
            if tol:
                torch.testing.assert_close(answer["grad"], ref.boundary_grads[b - 1], **tol, msg=f"dL/dh_{b - 1}")
            else:
                assert rel_err(answer["grad"], ref.boundary_grads[b - 1]) < 2e-2


def test_bytes_counted_are_the_tensors_sizes(probed):
    nodes, d = probed.nodes, probed.d
    pipe = {b: n.get("/v1/status")["self"]["pipeline"] for b, n in nodes.items()}
    assert all(p["settings"]["recompute"] is probed.recompute for p in pipe.values())   # the flags reached each engine
    assert all(p["settings"]["layer_checkpoint"] is probed.layer_checkpoint for p in pipe.values())
    tr = {b: p["traffic"] for b, p in pipe.items()}
    one = N * T * d * 4 + N * T * d * 2          # the fp32 micro-batch, then the fp16 one
    for b in range(3):        # each sender: both micro-batches went out once, and their gradients came back
        assert tr[b]["calls_out"] == 2 and tr[b]["calls_out_failed"] == 0, tr[b]
        assert tr[b]["activation_bytes_sent"] == one and tr[b]["gradient_bytes_received"] == one, tr[b]
        assert tr[b]["target_bytes_sent"] == 2 * N * T, tr[b]
    for b in range(1, 4):     # each stage received them, and answered the gradients in the caller's codec
        assert tr[b]["activation_bytes_received"] == one and tr[b]["gradient_bytes_sent"] == one, tr[b]
        assert tr[b]["target_bytes_received"] == 2 * N * T and tr[b]["calls_in"] == 2, tr[b]
    assert tr[0]["calls_in"] == 0 and tr[3]["calls_out"] == 0
    assert tr[0]["wire_bytes_sent"] > tr[0]["activation_bytes_sent"] + tr[0]["target_bytes_sent"]   # + framing
    metrics = nodes[1].get("/v1/status")["self"]["pipeline"]
    assert metrics["received"] == 2 and metrics["sent"] == 2 and metrics["lost"] == 0


def test_bad_activation_messages_are_refused_with_a_typed_error(probed):
    nodes, D, run = probed.nodes, probed.d, probed.run
    target = nodes[1]
    meta = {"v": 1, "request_id": "raw", "block_index": 1, "mode": "backprop", "codec": "fp32", "deadline_s": 30.0}
    y = encode_tensor(torch.randint(0, 256, (N, T), dtype=torch.int64))
    bad = {
        "bad_shape": [encode_tensor(torch.randn(N, T, D + 3)), y],
        "bad_value": [encode_tensor(torch.full((N, T, D), float("nan"))), y],
        "bad_dtype": [encode_tensor(torch.randn(N, T, D, dtype=torch.float64)), y],
        "malformed": [encode_tensor(torch.randn(N, T, D))],
    }
    loop = LoopThread()
    p2p = None
    try:
        p2p = loop.run(P2P.create(initial_peers=target.info["maddrs"]), timeout=60)
        resent = 0
        for code, tensors in bad.items():
            ans, got = loop.run(raw_train_call(p2p, target.info["peer_id"], run, 1, meta, tensors), timeout=60)
            if ans is None:   # the answer stream came back empty (CI 40 saw it once: a reset stream); one resend
                resent += 1
                ans, got = loop.run(raw_train_call(p2p, target.info["peer_id"], run, 1, meta, tensors), timeout=60)
            assert ans is not None and ans["ok"] is False and ans["code"] == code and not got, (code, ans)
        # the node lives on, counted the refusals, and still trains a good message through blocks 1..3
        good = StageRequest(1, torch.randn(N, T, D), torch.randint(0, 256, (N, T)), "backprop", "fp16",
                            deadline_s=60.0, request_id="good")
        raw_meta, pbs, _, _ = request_message(good)
        ans, got = loop.run(raw_train_call(p2p, target.info["peer_id"], run, 1, decode_meta(raw_meta), pbs), timeout=90)
        assert ans["ok"] is True and len(ans["route"]) == 3 and got[0].dtype == "float16", ans
        assert list(got[0].size) == [N, T, D]
    finally:
        if p2p is not None:
            loop.run(p2p.shutdown(), timeout=10)
        loop.stop()
    st = target.get("/v1/status")
    pipe = st["self"]["pipeline"]
    refused = pipe["traffic"]["calls_in_refused"]   # refused before the stage (a resent message may count twice)
    assert pipe["received"] == 3 and len(bad) <= refused <= len(bad) + resent, (refused, resent)
    assert st["self"]["state"] == "online" and target.alive
    metrics = httpx.get(target.url + "/metrics", timeout=30).text
    assert f"blocktrain_pipeline_calls_in_refused_total {float(refused)!r}" in metrics, metrics[:2000]
