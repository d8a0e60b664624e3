"""Which data a member reads for a run (node/runs.py): a manifest names a public dataset or the sha256
of private data; a member reads local files only when it passes --data itself."""
from __future__ import annotations

import hashlib
import os
import threading

import pytest

from blocktrain.blocks.data import resolve_data
from blocktrain.node.runs import DataSpecError, member_data, published_data_spec

from test_utils.configs import TEST_CORPUS

SEQ = 32


def test_a_seeder_publishes_names_as_is_and_local_data_as_its_sha256():
    split = resolve_data(str(TEST_CORPUS), seq_len=SEQ)
    assert published_data_spec("auto", split) == "auto"
    assert published_data_spec("wikitext-2", split) == "wikitext-2"
    spec = published_data_spec(str(TEST_CORPUS), split)
    assert spec == "sha256:" + hashlib.sha256(split.train.tobytes()).hexdigest()


def test_private_data_needs_the_members_own_copy(tmp_path):
    split = resolve_data(str(TEST_CORPUS), seq_len=SEQ)
    spec = published_data_spec(str(TEST_CORPUS), split)
    with pytest.raises(DataSpecError, match="pass --data"):
        member_data(spec, None, SEQ, tmp_path)
    got, used = member_data(spec, str(TEST_CORPUS), SEQ, tmp_path)   # --data given: that copy is read
    assert used == str(TEST_CORPUS) and bytes(got.train) == bytes(split.train)


def test_a_path_in_a_manifest_is_never_opened(tmp_path):
    """A manifest naming a path (records refuse one on the wire; this is the member's own guard) is
    refused without touching it: opening this FIFO for reading would block for good."""
    fifo = tmp_path / "private.fifo"
    os.mkfifo(fifo)
    out: dict = {}

    def call():
        try:
            member_data(str(fifo), None, SEQ, tmp_path)
        except Exception as e:   # the expected refusal, checked below
            out["error"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():   # it opened the FIFO: release it (a writer end) so the thread ends, then fail
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
        pytest.fail("member_data opened the path the manifest named")
    assert isinstance(out.get("error"), DataSpecError), out
    assert "not a public dataset" in str(out["error"])
