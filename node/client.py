"""A network client without a block: joins the DHT (client mode), reads the run's manifest, and
routes generation/scoring/export through live holders. Used by ``bt-node generate``, ``status``,
``export``, the swarm driver and the benchmarks."""
from __future__ import annotations

from pathlib import Path


from blocktrain.blocks import checkpoint as ckpt
from blocktrain.blocks.windows import eval_windows
from blocktrain.blocks.objectives import get_objective
from blocktrain.node import generation
from blocktrain.node.routing.ranking import HolderRanking
from blocktrain.node.routing.router import Router
from blocktrain.node.runs import resolve_run
from blocktrain.node.state_fetch import StateFetcher
from blocktrain.p2p.aioloop import LoopThread
from blocktrain.p2p.discovery import Discovery
from blocktrain.p2p.records import RunAddress, parse_run_address
from blocktrain.p2p.rpc_client import HopClient, get_node_info


class NetworkClient:
    """``run``: a run id, a run address (``RUN@SEEDER`` / ``RUN@/ip4/.../p2p/SEEDER``), a parsed
    :class:`RunAddress`, or None for the run the initial peers serve (see ``node/runs.py``)."""

    def __init__(self, initial_peers: list[str], run: str | RunAddress | None = None, *, hop_timeout: float = 20.0):
        address = run if isinstance(run, RunAddress) else parse_run_address(run)
        peers = list(initial_peers) + ([address.bootstrap] if address.bootstrap else [])
        if not peers:
            raise ValueError("give at least one --initial-peers multiaddr (or a run address RUN@/ip4/.../p2p/ID)")
        self.discovery = Discovery.start(initial_peers=peers, client_mode=True,
                                         run_ids=[address.run_id] if address.run_id else [])
        self.loop: LoopThread | None = None
        try:
            self.loop = LoopThread(name="bt-client")
            p2p = self.loop.run(self.discovery.dht.replicate_p2p(), timeout=30)
            ask = lambda peer: self.loop.run(get_node_info(p2p, peer, timeout=10), timeout=15)  # noqa: E731
            self.manifest, self.cfg = resolve_run(self.discovery, address, peers, ask)
            self.run_id = self.manifest.run_id
            self.objective = get_objective(self.cfg)
            self.hop_client = HopClient(p2p, self.run_id, loop=self.loop)
            ranking = HolderRanking()
            self.router = Router(self.discovery, self.hop_client, self.run_id, self.cfg.n_blocks,
                                 hop_timeout=hop_timeout, ranking=ranking)
            self.fetcher = StateFetcher(self.hop_client, self.objective, ranking=ranking)
        except BaseException:
            self.close()
            raise

    def holders(self):
        return self.discovery.list_holders(self.run_id)

    def generate(self, prompt: bytes, n_bytes: int, mode: str = "one_sweep", *, seed: int = 0,
                 temperature: float = 0.0) -> dict:
        return generation.generate(self.objective, self.router, prompt, n_bytes, mode, seed=seed,
                                   temperature=temperature)

    def chain_ce(self, eval_data, n_windows: int = 16, k: int = 2) -> dict:
        return generation.score(self.objective, self.router, eval_windows(eval_data, self.cfg.seq_len, n_windows), k)

    def export(self, out: str | Path, timeout: float = 60.0) -> dict:
        """Pull every block from a live holder into ``out`` (safetensors per block + config.json)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        holders = self.holders()
        got = {}
        for b in range(self.cfg.n_blocks):
            errors: list[str] = []
            f = self.fetcher.fetch(b, [h for h in holders.get(b, []) if h.state == "online"], errors=errors,
                                   timeout=timeout)
            if f is None:
                raise RuntimeError(f"block {b} has no live holder that delivered its state"
                                   + (f" ({'; '.join(errors)})" if errors else ""))
            step = int(f.meta.get("step", 0))
            ckpt.save_block(out / ckpt.block_filename(b), f.tensors, config=self.cfg, block_index=b, step=step,
                            samples_seen=int(f.meta.get("samples_seen", 0)))
            got[b] = {"peer": f.peer, "step": step}
        ckpt.save_config(out, self.cfg)
        return {"out": str(out), "blocks": got, "run_id": self.run_id, "config_hash": self.cfg.config_hash}

    def close(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        self.discovery.shutdown(withdraw=False)
