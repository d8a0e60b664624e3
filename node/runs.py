"""Which run a member joins, whose manifest it believes, and which data it reads.

Trust, in order:

1. a run address the member pasted (``RUN@SEEDER`` or ``RUN@/ip4/.../p2p/SEEDER``) pins the
   seeder: only a manifest signed by that key is believed;
2. otherwise the initial peers the member was given are asked which run they serve and under
   which seeder (``InfoService``), and that answer pins the seeder: a member trusts the address it
   was handed, not a DHT-wide list anyone can write to;
3. otherwise (the initial peer is a plain DHT node that serves no run) the DHT is read, and a run
   id claimed by more than one seeder key is refused, listing the claimants. A claim's
   ``created_at`` is the writer's own word and decides nothing.

Data: a manifest may only name a public dataset (resolved by each member through its own known
sources, never as a path) or the sha256 of private data. Local files are read only when the
member passes ``--data`` itself.
"""
from __future__ import annotations

import logging
from typing import Callable

from blocktrain.blocks.config import ModelConfig
from blocktrain.blocks.data import DataSplit, sha256_of
from blocktrain.blocks.default_data import AUTO, is_dataset_name, resolve_default, resolve_named
from blocktrain.p2p.addresses import peer_id_of
from blocktrain.p2p.errors import ConfigMismatchError, RecordError, RunNotFoundError
from blocktrain.p2p.records import RunAddress, RunManifest

log = logging.getLogger(__name__)

AskPeer = Callable[[str], list[dict]]   # peer id -> the runs it serves (InfoService)


class DataSpecError(ValueError):
    """The run's data cannot be used as published; the member must pass --data."""


def served_runs(initial_peers: list[str], ask: AskPeer) -> list[dict]:
    """What the initial peers say they serve (peers that do not answer are skipped)."""
    out: list[dict] = []
    for maddr in initial_peers:
        peer = peer_id_of(maddr)
        try:
            for r in ask(peer):
                if r not in out:
                    out.append(r)
        except Exception as e:   # a plain DHT node, or one that left: the DHT rule applies then
            log.warning("initial peer %s did not say which run it serves: %s", peer, e)
    return out


def resolve_run(discovery, address: RunAddress, initial_peers: list[str],
                ask: AskPeer) -> tuple[RunManifest, ModelConfig]:
    """The manifest this member believes for ``address`` (see the module docstring), and its config."""
    run_id, seeder = address.run_id, address.seeder
    if run_id is None or seeder is None:
        served = served_runs(initial_peers, ask)
        if run_id is None:
            ids = sorted({r["run_id"] for r in served})
            if not ids:
                raise RunNotFoundError("the initial peer(s) serve no run; pass --run RUN (or RUN@SEEDER_PEER_ID)")
            if len(ids) > 1:
                raise RecordError(f"the initial peers serve several runs ({', '.join(ids)}); pass --run RUN")
            run_id = ids[0]
        seeders = sorted({r["seeder"] for r in served if r["run_id"] == run_id})
        if seeder is None and len(seeders) == 1:
            seeder = seeders[0]
    discovery.follow_run(run_id)
    m = discovery.get_manifest(run_id, seeder=seeder)
    if m is None:
        by = f" by seeder {seeder}" if seeder else ""
        raise RunNotFoundError(f"no manifest of run {run_id!r}{by} found through "
                               f"{', '.join(initial_peers) or 'the DHT'}")
    cfg = ModelConfig.from_dict(m.model_config_dict, source=f"manifest of run {run_id}")
    if cfg.config_hash != m.config_hash:
        raise ConfigMismatchError(f"run {run_id!r}: manifest config hashes to {cfg.config_hash}, "
                                  f"but announces {m.config_hash}")
    discovery.trust(m)
    return m, cfg


def published_data_spec(local_spec: str, split: DataSplit) -> str:
    """What a seeder publishes for its ``--data``: a dataset name as is, anything local as the sha256
    of its training bytes (members bring their own copy)."""
    if local_spec == AUTO or is_dataset_name(local_spec):
        return local_spec
    return "sha256:" + sha256_of(split.train)


def member_data(published: str, local: str | None, seq_len: int, cache_dir) -> tuple[DataSplit, str]:
    """The data this member trains on: its own ``--data`` if given, else the run's named dataset.
    Training bytes of a file stay on disk (read window by window: a node holds none of its corpus)."""
    if local:
        return resolve_default(local, seq_len, cache_dir, file_backed=True)
    if published.startswith("sha256:"):
        raise DataSpecError(f"this run trains on private data ({published}); pass --data with your copy of it")
    if published != AUTO and not is_dataset_name(published):
        raise DataSpecError(f"the run's manifest names data {published!r}, which is not a public dataset; "
                            "refusing to read it from this machine. Pass --data to choose your own")
    return resolve_named(published, seq_len, cache_dir, file_backed=True)
