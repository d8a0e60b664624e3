"""Training bytes left on disk (``file_backed=True``, what a node asks for): the same windows as the
in-memory array, none of the corpus in memory, and a clear error when the file changes underneath."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from blocktrain.blocks.data import DataError, FileBytes, carve_validation, resolve_data, sha256_of
from blocktrain.blocks.windows import WindowSampler, eval_windows
from blocktrain.node.runs import member_data, published_data_spec


def _text(n: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return bytes(rng.integers(32, 127, size=n, dtype=np.uint8))


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_bytes(_text(200_000))
    return p


def test_file_backed_split_is_the_in_memory_split_byte_for_byte(corpus, tmp_path):
    mem = resolve_data(corpus, seq_len=32)
    fb = resolve_data(corpus, seq_len=32, file_backed=True)
    assert isinstance(fb.train, FileBytes) and isinstance(fb.eval, np.ndarray)
    assert (fb.protocol, fb.description) == (mem.protocol, mem.description)
    assert len(fb.train) == len(mem.train) and np.array_equal(np.asarray(fb.train), mem.train)
    assert np.array_equal(fb.eval, mem.eval)
    a, b = WindowSampler(mem.train, 32, seed=5, worker_id=2), WindowSampler(fb.train, 32, seed=5, worker_id=2)
    for _ in range(20):
        assert np.array_equal(a.next_batch(8).numpy(), b.next_batch(8).numpy())
    assert a.state_dict()["n_bytes"] == b.state_dict()["n_bytes"]
    assert np.array_equal(eval_windows(fb.train, 32, 64, seed=3).numpy(), eval_windows(mem.train, 32, 64, seed=3).numpy())
    # a train/test folder (Gutenberg's layout) and a carved validation part: views of the one open file
    folder = tmp_path / "books"
    folder.mkdir()
    (folder / "train.txt").write_bytes(_text(50_000, 1))
    (folder / "test.txt").write_bytes(_text(5_000, 2))
    m2, f2 = resolve_data(folder, seq_len=16), resolve_data(folder, seq_len=16, file_backed=True)
    assert isinstance(f2.train, FileBytes) and np.array_equal(f2.eval, m2.eval)
    (mt, mv), (ft, fv) = carve_validation(m2), carve_validation(f2)
    assert np.array_equal(np.asarray(ft.train), mt.train) and np.array_equal(np.asarray(fv.eval), mv.eval)


def test_indexing_hashing_and_bad_indices(corpus):
    fb = resolve_data(corpus, seq_len=32, file_backed=True).train
    raw = corpus.read_bytes()[: len(fb)]
    assert fb[0] == raw[0] and fb[-1] == raw[len(fb) - 1] and fb[10:20].tobytes() == raw[10:20]
    assert fb[100:][5:9].tobytes() == raw[105:109] and len(fb[5:2]) == 0
    assert sha256_of(fb) == hashlib.sha256(raw).hexdigest() == sha256_of(np.frombuffer(raw, np.uint8))
    with pytest.raises(IndexError):
        fb[len(fb)]
    with pytest.raises(TypeError):
        fb[::2]
    with pytest.raises(TypeError):
        fb[np.arange(3)]
    with pytest.raises(IndexError):
        fb.windows(np.array([len(fb) - 3]), 8)


def test_a_file_changed_underneath_is_a_clear_error_and_a_rename_keeps_the_old_bytes(corpus, tmp_path):
    fb = resolve_data(corpus, seq_len=32, file_backed=True).train
    sampler = WindowSampler(fb, 32, seed=1)
    sampler.next_batch(4)
    # replaced by a rename (how editors and `cp` to a temp then `mv` save): the open file keeps its bytes
    old = corpus.read_bytes()
    new = tmp_path / "new.txt"
    new.write_bytes(_text(len(old), 9))
    os.replace(new, corpus)
    assert fb[:64].tobytes() == old[:64]
    sampler.next_batch(4)
    # truncated in place: the next batch says so, naming the file
    fb2 = resolve_data(corpus, seq_len=32, file_backed=True).train
    s2 = WindowSampler(fb2, 32, seed=1)
    s2.next_batch(4)
    with open(corpus, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(DataError, match="corpus.txt: the file changed after it was opened"):
        s2.next_batch(4)
    # rewritten in place with the same size: also refused (it would train on other bytes)
    corpus.write_bytes(_text(50_000, 4))
    fb3 = resolve_data(corpus, seq_len=32, file_backed=True).train
    st = os.stat(corpus)
    with open(corpus, "r+b") as f:
        f.write(b"x" * 100)
    os.utime(corpus, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(DataError, match="changed after it was opened"):
        fb3.windows(np.array([0]), 8)
    with pytest.raises(DataError, match="cannot read"):
        FileBytes(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        resolve_data(tmp_path / "empty.txt", file_backed=True)


def test_a_member_keeps_its_training_file_on_disk_and_publishes_the_same_hash(corpus, tmp_path):
    split, used = member_data("sha256:whatever", str(corpus), 32, tmp_path)
    assert used == str(corpus) and isinstance(split.train, FileBytes)
    mem = resolve_data(corpus, seq_len=32)
    assert published_data_spec(str(corpus), split) == published_data_spec(str(corpus), mem)


_RSS_PROBE = textwrap.dedent("""
    import sys
    from blocktrain.blocks.data import resolve_data
    from blocktrain.blocks.windows import WindowSampler
    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    before = anon()
    split = resolve_data(sys.argv[1], seq_len=256, file_backed=sys.argv[2] == "1")
    s = WindowSampler(split.train, 256, seed=0)
    for _ in range(300):
        s.next_batch(16)
    print((anon() - before) / 2**20)
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
def test_file_backed_training_bytes_take_no_anonymous_memory(tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(_text(64 << 20, 7))
    grew = {}
    for fb in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(big), fb], capture_output=True, text=True,
                             timeout=120, check=True)
        grew[fb] = float(out.stdout.split()[-1])
    # in memory: the 64 MiB of training bytes (and the 5% held out) are anonymous memory; on disk: none
    assert grew["0"] > 60, grew
    assert grew["1"] < 12, grew
