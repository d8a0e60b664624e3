"""blocks/checkpoint.py: round trip, rejection of bad files, atomic writes, directories."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.checkpoint import (
    CheckpointError, block_filename, load_block, load_checkpoint_dir, load_reference, save_block,
    save_config, save_reference,
)
from blocktrain.blocks.config import ModelConfig

CFG = ModelConfig(d_model=16, n_heads=2, n_blocks=3, seq_len=32, target_dim=8, chunk_len=8)


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 8)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _save(path, b=1, step=7, config=CFG, **kw):
    model, opt = _model_and_optimizer(b + step)
    save_block(path, model.state_dict(), config=config, block_index=b, step=step, samples_seen=step * 16,
               **kw)
    return model, opt


def _leftovers(d):
    return sorted(p.name for p in d.iterdir() if ".tmp-" in p.name)


def test_round_trip_tensors_meta_config_optimizer(tmp_path):
    model, opt = _model_and_optimizer(1)
    sd = model.state_dict()
    path = save_block(tmp_path / block_filename(1), sd, config=CFG, block_index=1, step=42,
                      samples_seen=672, extra_meta={"note": "hello"}, optimizer_state=opt.state_dict())
    assert path.name == "block01.safetensors"
    ck = load_block(path, expected_config_hash=CFG.config_hash, expected_block=1)
    assert set(ck.tensors) == set(sd)
    for k, v in sd.items():
        assert torch.equal(ck.tensors[k], v) and ck.tensors[k].dtype == v.dtype
    assert (ck.step, ck.samples_seen, ck.block_index, ck.config_hash) == (42, 672, 1, CFG.config_hash)
    assert ck.meta["format_version"] == 1 and ck.meta["objective"] == CFG.objective
    assert ck.meta["kind"] == "block" and ck.meta["note"] == "hello"
    assert ck.config == CFG

    ref_state = opt.state_dict()
    got = ck.optimizer_state
    assert got is not None and got["param_groups"] == ref_state["param_groups"]
    assert got["state"].keys() == ref_state["state"].keys()
    for pid, st in ref_state["state"].items():
        for name, value in st.items():
            assert torch.equal(got["state"][pid][name], value)
    # the loaded optimizer state is usable
    model2, opt2 = _model_and_optimizer(9)
    model2.load_state_dict(ck.tensors)
    opt2.load_state_dict(got)
    assert opt2.state_dict()["state"][0]["step"] == ref_state["state"][0]["step"]

    no_opt = load_block(path, load_optimizer=False)
    assert no_opt.optimizer_state is None


def test_shared_and_strided_tensors_are_saved_as_copies(tmp_path):
    w = torch.randn(6, 6)
    sd = {"w": w, "tied": w, "col": w[:, 1], "t": w.t(), "bf16": torch.randn(3).to(torch.bfloat16)}
    path = save_block(tmp_path / "b.safetensors", sd, config=CFG, block_index=0, step=0, samples_seen=0)
    ck = load_block(path)
    for k, v in sd.items():
        assert torch.equal(ck.tensors[k], v)
    assert w.data_ptr() != ck.tensors["w"].data_ptr()


def test_truncated_file_rejected_naming_file(tmp_path):
    path = tmp_path / block_filename(1)
    _save(path)
    blob = path.read_bytes()
    bad = tmp_path / "half.safetensors"
    bad.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match=r"half\.safetensors.*(truncated|corrupted)"):
        load_block(bad)
    bad.write_bytes(blob[:-1])
    with pytest.raises(CheckpointError, match=r"half\.safetensors"):
        load_block(bad)


def test_random_bytes_and_missing_file_rejected(tmp_path):
    bad = tmp_path / "noise.safetensors"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match=r"noise\.safetensors"):
        load_block(bad)
    with pytest.raises(CheckpointError, match=r"absent\.safetensors.*not found"):
        load_block(tmp_path / "absent.safetensors")


def test_foreign_safetensors_rejected(tmp_path):
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(3)}, str(foreign))
    with pytest.raises(CheckpointError, match=r"foreign\.safetensors.*not a BlockTrain checkpoint"):
        load_block(foreign)
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(3)}, str(other), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"other\.safetensors.*format='pt'"):
        load_block(other)


def test_unsupported_format_version_rejected(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt, "FORMAT_VERSION", "99")
    path = tmp_path / "future.safetensors"
    _save(path)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"future\.safetensors.*version '99'"):
        load_block(path)


def test_wrong_config_hash_and_wrong_block_rejected(tmp_path):
    path = tmp_path / block_filename(2)
    _save(path, b=2)
    other = CFG.replace(d_model=32)
    assert other.config_hash != CFG.config_hash
    with pytest.raises(CheckpointError, match=rf"{path.name}.*trained under config {CFG.config_hash}, "
                                              rf"this run is {other.config_hash}"):
        load_block(path, expected_config_hash=other.config_hash)
    with pytest.raises(CheckpointError, match=rf"{path.name}.*holds block 2, expected block 0"):
        load_block(path, expected_block=0)
    # a non-hashed field (batch size) does not make a checkpoint foreign
    assert load_block(path, expected_config_hash=CFG.replace(batch_size=64).config_hash).block_index == 2


def test_block_and_reference_files_are_not_confused(tmp_path):
    model, _ = _model_and_optimizer()
    ref = save_reference(tmp_path / "reference.safetensors", model.state_dict(), config=CFG, step=3,
                         samples_seen=48, extra_meta={"layers": "6"})
    ck = load_reference(ref, expected_config_hash=CFG.config_hash)
    assert ck.kind == "reference" and ck.block_index == -1 and ck.meta["layers"] == "6"
    with pytest.raises(CheckpointError, match="reference checkpoint, expected a block"):
        load_block(ref)
    blk = tmp_path / block_filename(0)
    _save(blk, b=0)
    with pytest.raises(CheckpointError, match="block checkpoint, expected a reference"):
        load_reference(blk)


def test_crash_during_replace_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / block_filename(1)
    old_model, old_opt = _model_and_optimizer(1)
    save_block(path, old_model.state_dict(), config=CFG, block_index=1, step=10, samples_seen=160,
               optimizer_state=old_opt.state_dict())
    files_before = sorted(p.name for p in tmp_path.iterdir())

    def crash(src, dst):
        raise OSError("simulated power loss")

    monkeypatch.setattr(os, "replace", crash)
    new_model, new_opt = _model_and_optimizer(2)
    with pytest.raises(OSError, match="simulated"):
        save_block(path, new_model.state_dict(), config=CFG, block_index=1, step=20, samples_seen=320,
                   optimizer_state=new_opt.state_dict())
    monkeypatch.undo()

    assert _leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == files_before
    ck = load_block(path)
    assert ck.step == 10
    for k, v in old_model.state_dict().items():
        assert torch.equal(ck.tensors[k], v)
    assert torch.equal(ck.optimizer_state["state"][0]["exp_avg"], old_opt.state_dict()["state"][0]["exp_avg"])


def test_crash_between_optimizer_and_weights_keeps_previous(tmp_path, monkeypatch):
    """The optimizer file is already in place when writing the weights fails half-way."""
    path = tmp_path / block_filename(1)
    old_model, old_opt = _model_and_optimizer(1)
    save_block(path, old_model.state_dict(), config=CFG, block_index=1, step=10, samples_seen=160,
               optimizer_state=old_opt.state_dict())
    files_before = sorted(p.name for p in tmp_path.iterdir())

    def half_write(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"partial")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(ckpt, "save_file", half_write)
    new_model, new_opt = _model_and_optimizer(2)
    with pytest.raises(KeyboardInterrupt):
        save_block(path, new_model.state_dict(), config=CFG, block_index=1, step=20, samples_seen=320,
                   optimizer_state=new_opt.state_dict())
    monkeypatch.undo()

    assert _leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == files_before  # new optimizer file removed too
    ck = load_block(path)
    assert ck.step == 10
    assert torch.equal(ck.optimizer_state["state"][0]["exp_avg"], old_opt.state_dict()["state"][0]["exp_avg"])


def test_resave_replaces_and_cleans_stale_optimizer_file(tmp_path):
    path = tmp_path / block_filename(0)
    _, opt1 = _model_and_optimizer(1)
    m2, opt2 = _model_and_optimizer(2)
    save_block(path, m2.state_dict(), config=CFG, block_index=0, step=1, samples_seen=1,
               optimizer_state=opt1.state_dict())
    save_block(path, m2.state_dict(), config=CFG, block_index=0, step=2, samples_seen=2,
               optimizer_state=opt2.state_dict())
    optim_files = [p.name for p in tmp_path.iterdir() if ".optim-" in p.name]
    assert len(optim_files) == 1
    ck = load_block(path)
    assert ck.step == 2 and ck.meta["optimizer_file"] == optim_files[0]
    # a tampered optimizer file is detected
    (tmp_path / optim_files[0]).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="optimizer state does not match"):
        load_block(path)
    # bytes that hash right but are no torch file (a writer of ours never makes one): a clear error too
    meta = dict(ck.meta)
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        raw = f.metadata()
    raw["optimizer_sha256"] = hashlib.sha256(b"garbage").hexdigest()
    save_file(tensors, str(path), metadata=raw)
    with pytest.raises(CheckpointError, match="cannot load optimizer state"):
        load_block(path)
    assert load_block(path, load_optimizer=False).step == meta["step"]
    (tmp_path / optim_files[0]).unlink()                      # and a missing one
    with pytest.raises(CheckpointError, match="optimizer state file .* cannot be read"):
        load_block(path)


def test_checkpoint_dir_round_trip_and_errors(tmp_path):
    save_config(tmp_path, CFG)
    assert ModelConfig.from_dict(json.loads((tmp_path / "config.json").read_text())) == CFG
    for b in range(CFG.n_blocks):
        _save(tmp_path / block_filename(b), b=b)
    config, blocks = load_checkpoint_dir(tmp_path, expected_config_hash=CFG.config_hash)
    assert config == CFG and sorted(blocks) == [0, 1, 2]
    assert all(blocks[b].block_index == b for b in blocks)

    with pytest.raises(CheckpointError, match="this run is"):
        load_checkpoint_dir(tmp_path, expected_config_hash="0" * 16)

    (tmp_path / block_filename(1)).unlink()
    with pytest.raises(CheckpointError, match=r"missing 1 of 3 block\(s\): 1 \(block01\.safetensors\)"):
        load_checkpoint_dir(tmp_path)
    _, partial = load_checkpoint_dir(tmp_path, require_all=False)
    assert sorted(partial) == [0, 2]

    # a block from another config in the same directory
    other = CFG.replace(d_model=32)
    _save(tmp_path / block_filename(1), b=1, config=other)
    with pytest.raises(CheckpointError, match=rf"block01\.safetensors.*config {other.config_hash}.*config\.json"):
        load_checkpoint_dir(tmp_path)

    # a block file whose name and content disagree
    (tmp_path / block_filename(1)).unlink()
    os.rename(tmp_path / block_filename(2), tmp_path / block_filename(1))
    with pytest.raises(CheckpointError, match="holds block 2, expected block 1"):
        load_checkpoint_dir(tmp_path)

    # a broken config.json: named once, with the problem
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint_dir(tmp_path)
    assert str(e.value).count("config.json") == 1 and "not valid JSON" in str(e.value), str(e.value)


def test_save_rejects_bad_arguments(tmp_path):
    sd = {"w": torch.zeros(2)}
    with pytest.raises(CheckpointError, match="block_index"):
        save_block(tmp_path / "x.safetensors", sd, config=CFG, block_index=CFG.n_blocks, step=0, samples_seen=0)
    with pytest.raises(CheckpointError, match="reserved"):
        save_block(tmp_path / "x.safetensors", sd, config=CFG, block_index=0, step=0, samples_seen=0,
                   extra_meta={"step": "5"})
    with pytest.raises(CheckpointError, match="step"):
        save_block(tmp_path / "x.safetensors", sd, config=CFG, block_index=0, step=-1, samples_seen=0)
    assert list(tmp_path.iterdir()) == []


def test_a_crash_while_the_optimizer_state_streams_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """The optimizer state is written straight into its temporary file: dying half-way through leaves
    the previous checkpoint whole and no temporary file; saving the same state twice reuses its file."""
    path = tmp_path / block_filename(1)
    old_model, old_opt = _model_and_optimizer(1)
    save_block(path, old_model.state_dict(), config=CFG, block_index=1, step=10, samples_seen=160,
               optimizer_state=old_opt.state_dict())
    files_before = sorted(p.name for p in tmp_path.iterdir())
    writes = []
    real_write = ckpt._HashingWriter.write

    def dies_half_way(self, b):
        writes.append(len(b))
        if len(writes) == 3:
            raise KeyboardInterrupt("killed mid-write")
        return real_write(self, b)

    monkeypatch.setattr(ckpt._HashingWriter, "write", dies_half_way)
    new_model, new_opt = _model_and_optimizer(2)
    with pytest.raises((KeyboardInterrupt, RuntimeError)):   # torch's zip writer may re-raise as its own
        save_block(path, new_model.state_dict(), config=CFG, block_index=1, step=20, samples_seen=320,
                   optimizer_state=new_opt.state_dict())
    monkeypatch.undo()
    assert len(writes) == 3 and _leftovers(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == files_before
    assert load_block(path).step == 10
    save_block(path, old_model.state_dict(), config=CFG, block_index=1, step=11, samples_seen=176,
               optimizer_state=old_opt.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == files_before and _leftovers(tmp_path) == []
    ck = load_block(path)
    assert ck.step == 11
    assert torch.equal(ck.optimizer_state["state"][0]["exp_avg_sq"], old_opt.state_dict()["state"][0]["exp_avg_sq"])


_SAVE_PEAK = """
import sys, torch
from blocktrain.blocks.checkpoint import save_block
from blocktrain.blocks.config import ModelConfig
def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
w = {"w": torch.randn(4096, 4096)}                                   # 64 MiB of weights
opt = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4096, 4096),
                     "exp_avg_sq": torch.rand(4096, 4096)}}, "param_groups": [{"lr": 1e-3, "params": [0]}]}
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                                     # VmHWM := VmRSS
before = kib("VmRSS:")
save_block(sys.argv[1], w, config=ModelConfig(d_model=16, n_heads=2, n_blocks=3, seq_len=32), block_index=0,
           step=1, samples_seen=1, optimizer_state=opt)
print((kib("VmHWM:") - before) / 1024)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="resets VmHWM through /proc")
def test_saving_holds_no_copy_of_the_optimizer_state(tmp_path):
    """A checkpoint of a block with 64 MiB of weights and 128 MiB of AdamW moments: the save's peak
    above what the process held is a few MiB, not a serialized copy of the state (128 MiB and more,
    as when the state went through an in-memory buffer first)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _SAVE_PEAK, str(tmp_path / block_filename(0))],
                         capture_output=True, text=True, timeout=120, check=True)
    grew = float(out.stdout.split()[-1])
    assert grew < 24, grew
    assert load_block(tmp_path / block_filename(0)).optimizer_state["state"][0]["exp_avg"].shape == (4096, 4096)


_LOAD_PEAK = """
import sys
from blocktrain.blocks.checkpoint import load_block
def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])
import torch                                                         # imported before the baseline
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                                     # VmHWM := VmRSS
before = kib("VmRSS:")
ck = load_block(sys.argv[1])
assert ck.optimizer_state["state"][0]["exp_avg"].shape == (4096, 4096)
print((kib("VmHWM:") - before) / 1024)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="resets VmHWM through /proc")
def test_resuming_holds_no_copy_of_the_optimizer_file(tmp_path):
    """Loading that checkpoint back (64 MiB of weights, 128 MiB of moments) peaks at what it loads, not
    also at a copy of the optimizer file's bytes (another 128 MiB, as when the file was read whole to
    hash it and then deserialized from that buffer)."""
    import subprocess
    import sys
    path = str(tmp_path / block_filename(0))
    subprocess.run([sys.executable, "-c", _SAVE_PEAK, path], capture_output=True, text=True, timeout=120, check=True)
    out = subprocess.run([sys.executable, "-c", _LOAD_PEAK, path], capture_output=True, text=True, timeout=120,
                         check=True)
    grew = float(out.stdout.split()[-1])
    # the moments themselves (128 MiB; safetensors maps the weights' file) and little more: 131 MiB here,
    # 259 MiB when the file was read whole first (2026-12-03)
    assert 120 < grew < 128 + 64, grew
