"""blocks/data.py: source resolution, protocols, windows."""
from __future__ import annotations

import hashlib
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from blocktrain.blocks.data import DataError, describe_bytes, load_source, resolve_data
from blocktrain.blocks.windows import WindowSampler, eval_windows

from test_utils.configs import TEST_CORPUS, TEST_CORPUS_PROTOCOL


def _text(n: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return bytes(rng.integers(32, 127, size=n, dtype=np.uint8))


# -- sources ----------------------------------------------------------------------------------
def test_text_file_holds_out_last_five_percent(tmp_path):
    blob = _text(1000)
    f = tmp_path / "corpus.txt"
    f.write_bytes(blob)
    split = resolve_data(str(f))
    assert split.protocol == "corpus.txt (last 5% held out)"
    assert split.train.dtype == np.uint8 and split.eval.dtype == np.uint8
    assert len(split.train) == 950 and len(split.eval) == 50
    assert split.train.tobytes() == blob[:950]
    assert split.eval.tobytes() == blob[950:]
    assert "corpus.txt" in split.description


def test_holdout_fraction_is_respected(tmp_path):
    f = tmp_path / "c.txt"
    f.write_bytes(_text(2000))
    split = resolve_data(str(f), holdout=0.1)
    assert (len(split.train), len(split.eval)) == (1800, 200)
    assert split.protocol == "c.txt (last 10% held out)"


def test_folder_of_text_files_sorted_joined_binary_skipped(tmp_path):
    (tmp_path / "b.md").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "c.raw").write_bytes(b"third")
    (tmp_path / "image.txt").write_bytes(b"\x89PNG\x00\x00binary")
    (tmp_path / "weights.bin").write_bytes(b"ignored suffix")
    (tmp_path / ".hidden.txt").write_bytes(b"hidden")
    corpus = load_source(str(tmp_path))
    assert corpus.kind == "folder"
    assert corpus.splits["all"].tobytes() == b"first\nsecond\nthird"
    assert any("image.txt" in n for n in corpus.notes)


def test_folder_without_text_files_is_an_error(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\x00\x01")
    with pytest.raises(DataError, match=str(tmp_path)):
        load_source(str(tmp_path))


def test_eval_src_overrides_holdout_and_splits(tmp_path):
    train, ev = tmp_path / "train_here.txt", tmp_path / "eval_there.txt"
    train.write_bytes(_text(500, 1))
    ev.write_bytes(_text(300, 2))
    split = resolve_data(str(train), eval_src=str(ev))
    assert split.train.tobytes() == train.read_bytes()  # nothing held out
    assert split.eval.tobytes() == ev.read_bytes()
    assert split.protocol == "train=train_here.txt, eval=eval_there.txt"


def test_train_test_folder_and_wikitext_folder_with_train(tmp_path):
    tt = tmp_path / "mycorpus"
    tt.mkdir()
    (tt / "train.txt").write_bytes(b"t" * 100)
    (tt / "test.txt").write_bytes(b"e" * 40)
    split = resolve_data(str(tt))
    assert split.protocol == "train.txt/test.txt"
    assert split.train.tobytes() == b"t" * 100 and split.eval.tobytes() == b"e" * 40

    wt = tmp_path / "wt"
    wt.mkdir()
    for name, ch in (("wiki.train.raw", b"a"), ("wiki.valid.raw", b"b"), ("wiki.test.raw", b"c")):
        (wt / name).write_bytes(ch * 64)
    split = resolve_data(str(wt))
    assert split.train.tobytes() == b"a" * 64 and split.eval.tobytes() == b"c" * 64
    assert split.protocol == "wikitext-raw:train/test"


def _wikitext_offline_folder(tmp_path: Path) -> Path:
    """A WikiText-2 raw folder as the project's shared data holds it: valid and test splits, no train split."""
    wt = tmp_path / "wikitext-2-raw"
    wt.mkdir()
    (wt / "wiki.valid.raw").write_bytes(b" = Valkyria = \n" + _text(3000, 3))
    (wt / "wiki.test.raw").write_bytes(b" = Robert = \n" + _text(2000, 4))
    return wt


def test_wikitext_folder_without_train_split_is_wt2_offline(tmp_path):
    wt = _wikitext_offline_folder(tmp_path)
    split = resolve_data(str(wt), seq_len=256)
    assert split.protocol == "wt2-offline"
    assert split.train.tobytes() == (wt / "wiki.valid.raw").read_bytes()
    assert split.eval.tobytes() == (wt / "wiki.test.raw").read_bytes()
    assert split.train_name == "wikitext-2-raw/wiki.valid.raw" and split.eval_name == "wikitext-2-raw/wiki.test.raw"


def test_eval_src_overrides_wikitext_test_split(tmp_path):
    wt = _wikitext_offline_folder(tmp_path)
    ev = tmp_path / "mine.txt"
    ev.write_bytes(_text(4000))
    split = resolve_data(str(wt), eval_src=str(ev))
    assert split.train.tobytes() == (wt / "wiki.valid.raw").read_bytes()
    assert split.eval.tobytes() == ev.read_bytes()
    assert split.protocol == "train=wikitext-2-raw/wiki.valid.raw, eval=mine.txt"


def test_gutenberg_folder_protocol(tmp_path):
    named = tmp_path / "gutenberg"      # the shared corpus's folder name
    manifest = tmp_path / "books"       # or any folder with the corpus's MANIFEST.tsv
    for folder in (named, manifest):
        folder.mkdir()
        (folder / "train.txt").write_bytes(_text(3000, 5))
        (folder / "test.txt").write_bytes(_text(700, 6))
    (manifest / "MANIFEST.tsv").write_text(   # the shared corpus's header line
        "ebook\ttitle\tauthor\tbytes\tsha256\tsource_repo\tpath\tcommit\tsplit\tfile\n")
    for folder in (named, manifest):
        split = resolve_data(str(folder))
        assert split.protocol == "gutenberg-offline"
        assert (len(split.train), len(split.eval)) == (3000, 700)
    (manifest / "MANIFEST.tsv").write_text("name\tbytes\n")   # another manifest: a plain train/test folder
    assert resolve_data(str(manifest)).protocol == "train.txt/test.txt"


def test_shipped_test_corpus_is_the_book_slice_its_readme_names():
    readme = (TEST_CORPUS / "README.md").read_text()
    split = resolve_data(str(TEST_CORPUS), seq_len=256)
    assert split.protocol == TEST_CORPUS_PROTOCOL
    for name, part in (("train.txt", split.train), ("test.txt", split.eval)):
        row = next(line for line in readme.splitlines() if line.startswith(f"| {name} |"))
        size, digest = (c.strip() for c in row.strip("|").split("|")[2:4])
        assert len(part) == int(size.replace(",", ""))
        assert hashlib.sha256(part.tobytes()).hexdigest() == digest
    assert "#773" in readme and "Oscar Wilde" in readme
    assert len(split.train) + len(split.eval) == 225_750 <= 300_000


def test_hf_source_joins_rows_and_labels_protocol(monkeypatch):
    rows = {"train": [" = A = \n", "text one\n"], "validation": ["v\n"], "test": [" = B = \n", "two\n"]}
    calls = []

    def load_dataset(name, config):
        calls.append((name, config))
        return {k: {"text": v} for k, v in rows.items()}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    split = resolve_data("wikitext-2")
    assert calls == [("wikitext", "wikitext-2-raw-v1")]
    assert split.train.tobytes() == b" = A = \ntext one\n"
    assert split.eval.tobytes() == b" = B = \ntwo\n"
    assert split.protocol == "wikitext-2-raw-v1 (HF train/test)"


def test_hf_source_without_datasets_or_network_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(DataError, match=r"wikitext-103.*datasets"):
        resolve_data("wikitext-103")

    def offline(name, config):
        raise ConnectionError("no route to host")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(DataError, match=r"wikitext-2.*no route to host"):
        resolve_data("wikitext-2")


def test_missing_path_empty_file_and_too_small_data(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=r"nope\.txt.*no such file"):
        resolve_data(str(missing))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.txt.*empty"):
        resolve_data(str(empty))
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 100)
    with pytest.raises(DataError, match=r"small\.txt"):
        resolve_data(str(small), seq_len=64)  # needs >= 2 * 65 bytes
    with pytest.raises(DataError, match="holdout"):
        resolve_data(str(small), holdout=1.5)


def test_describe_bytes():
    assert describe_bytes(1) == "1 byte"
    assert describe_bytes(999) == "999 bytes"
    assert describe_bytes(1_146_846) == "1.15 MB (1,146,846 bytes)"
    assert describe_bytes(58_722_009) == "58.72 MB (58,722,009 bytes)"


# -- windows ----------------------------------------------------------------------------------
DATA = np.frombuffer(_text(5000, 7), dtype=np.uint8)


def test_window_sampler_shape_and_content():
    s = WindowSampler(DATA, seq_len=32, seed=3)
    batch = s.next_batch(8)
    assert batch.dtype == torch.long and batch.shape == (8, 33)
    flat = DATA.tobytes()
    for row in batch:
        window = bytes(row.tolist())
        assert window in flat  # a contiguous slice of the data


def test_window_sampler_determinism_and_workers():
    a = WindowSampler(DATA, 16, seed=1, worker_id=0)
    b = WindowSampler(DATA, 16, seed=1, worker_id=0)
    c = WindowSampler(DATA, 16, seed=1, worker_id=1)
    d = WindowSampler(DATA, 16, seed=2, worker_id=0)
    ba = [a.next_batch(4) for _ in range(3)]
    bb = [b.next_batch(4) for _ in range(3)]
    bc = [c.next_batch(4) for _ in range(3)]
    bd = [d.next_batch(4) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(ba, bb))
    assert not torch.equal(torch.cat(ba), torch.cat(bc))
    assert not torch.equal(torch.cat(ba), torch.cat(bd))


def test_window_sampler_resume_continues_the_same_stream():
    ref = WindowSampler(DATA, 16, seed=5, worker_id=2)
    for _ in range(3):
        ref.next_batch(4)
    state = ref.state_dict()
    expected = [ref.next_batch(4) for _ in range(4)]

    resumed = WindowSampler(DATA, 16, seed=999, worker_id=0)  # seed is restored from the state
    resumed.load_state_dict(state)
    assert resumed.batches_drawn == 3 and resumed.windows_drawn == 12
    got = [resumed.next_batch(4) for _ in range(4)]
    assert all(torch.equal(x, y) for x, y in zip(expected, got))

    other = WindowSampler(DATA[:-1], 16)
    with pytest.raises(DataError, match="n_bytes"):
        other.load_state_dict(state)


def test_eval_windows_fixed_evenly_spaced_non_overlapping():
    w1 = eval_windows(DATA, seq_len=31, n_windows=10)
    w2 = eval_windows(DATA, seq_len=31, n_windows=10)
    assert w1.dtype == torch.long and w1.shape == (10, 32)
    assert torch.equal(w1, w2)
    flat = DATA.tobytes()
    starts = [flat.find(bytes(r.tolist())) for r in w1]
    assert starts[0] == 0 and all(s >= 0 for s in starts)
    gaps = np.diff(starts)
    assert (gaps >= 32).all()  # non-overlapping
    assert len(set(gaps.tolist())) == 1  # evenly spaced
    shifted = eval_windows(DATA, seq_len=31, n_windows=10, seed=4)
    assert torch.equal(shifted, eval_windows(DATA, seq_len=31, n_windows=10, seed=4))


def test_eval_windows_short_data_uses_what_fits():
    w = eval_windows(DATA[:100], seq_len=31, n_windows=10)
    assert w.shape == (3, 32)  # 100 // 32
    expected = np.stack([DATA[s:s + 32] for s in (0, 33, 66)])  # grid spacing 100 // 3
    assert torch.equal(w, torch.from_numpy(expected).long())
    with pytest.raises(DataError, match="at least one window"):
        eval_windows(DATA[:20], seq_len=31, n_windows=10)
