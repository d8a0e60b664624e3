"""bench compression: the simulated all-reduce follows hivemind's, and the --tiny --json path works.

Only structural facts are asserted (exact averages without a codec, where the codec's error lands,
that coarser codecs move the weights further); the issue's quality goal is a benchmark figure.
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("hivemind")

from blocktrain.p2p.averager import make_compression, patch_8bit_decoder  # noqa: E402
from blocktrain.p2p.offline_wire import butterfly_average, codec_round_trip  # noqa: E402

from test_utils.configs import TEST_CORPUS, TEST_CORPUS_PROTOCOL  # noqa: E402
from test_utils.zygote import run_cli  # noqa: E402


def _replicas(g, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(300, 200), (200,), (70_000,), (5,)]   # the 70k tensor spans several 512 KiB parts in fp16
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(g)]


def test_without_a_codec_every_replica_gets_the_exact_mean():
    reps = _replicas(3)
    out = butterfly_average(reps, make_compression("fp32"))
    for i in range(4):
        mean = torch.stack([r[i] for r in reps]).mean(0)
        for r in range(3):
            assert out[r][i].shape == reps[r][i].shape
            assert torch.allclose(out[r][i], mean, atol=1e-6)


def test_fp16_errors_are_codec_sized_and_the_reducer_keeps_the_exact_average():
    reps = _replicas(2, seed=1)
    out = butterfly_average(reps, make_compression("fp16"))
    flat = [torch.cat([t.reshape(-1) for t in r]) for r in reps]
    got = [torch.cat([t.reshape(-1) for t in o]) for o in out]
    n = flat[0].numel()
    # hivemind gives peer 0 the first half of the values to reduce (rounded to whole parts)
    exact = ((flat[0] + flat[1].half().float()) / 2)[: n // 4]
    assert torch.equal(got[0][: n // 4], exact)
    # everywhere, each replica is within fp16 rounding of the true mean, and not bit-identical to it
    mean = (flat[0] + flat[1]) / 2
    for g in got:
        err = (g - mean).abs().max().item()
        assert 0 < err < 5e-3
    assert not torch.equal(got[0], got[1])


def test_8bit_codec_moves_weights_further_than_fp16():
    patch_8bit_decoder()
    reps = _replicas(2, seed=2)
    mean = torch.cat([(a.reshape(-1) + b.reshape(-1)) / 2 for a, b in zip(*reps)])
    errs = {}
    for name in ("fp16", "8bit"):
        out = butterfly_average(reps, make_compression(name))
        errs[name] = float((torch.cat([t.reshape(-1) for t in out[1]]) - mean).norm() / mean.norm())
    assert 0 < errs["fp16"] < errs["8bit"] < 0.2, errs
    x = torch.randn(1000)
    assert torch.equal(codec_round_trip(make_compression("fp32"), x), x)


def test_bench_compression_tiny_json():
    p = run_cli(["bench", "compression", "--tiny", "--json", "--data", str(TEST_CORPUS)], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1
    r = json.loads(lines[0])
    assert r["protocol"] == TEST_CORPUS_PROTOCOL
    assert r["bench"] == "compression" and set(r["runs"]) == {"baseline", "fp32", "fp16", "8bit"}
    assert r["runs"]["baseline"]["workers"] == 2 and r["runs"]["fp32"]["workers"] == 3
    assert r["runs"]["fp32"]["replica_spread_l2"] < 1e-5            # fp32 replicas agree after the last round
    assert 0 < r["runs"]["fp16"]["weights_rel_l2_vs_fp32"] < r["runs"]["8bit"]["weights_rel_l2_vs_fp32"]
    for run in r["runs"].values():
        assert 0 < run["chain_ce"] < 10
    assert "fp16_ce_within_0.01" in r["goals"]
    p = run_cli(["bench", "compression", "--tiny", "--compression", "bogus"], timeout=60)
    assert p.returncode == 2 and "bogus" in p.stderr
