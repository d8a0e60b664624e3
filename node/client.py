"""A network client without a block: joins the DHT (client mode), reads the run's manifest, and
routes generation/scoring/export through live holders. Used by ``bt-node generate``, ``status``,
``export``, the swarm driver and the benchmarks."""
from __future__ import annotations

from pathlib import Path


from ..blocks import checkpoint as ckpt
from ..blocks.config import ModelConfig
from ..blocks.windows import eval_windows
from ..blocks.objectives import get_objective
from ..p2p.aioloop import LoopThread
from ..p2p.discovery import Discovery
from ..p2p.errors import RunNotFoundError
from ..p2p.rpc_client import HopClient
from . import generation
from blocktrain.node.routing.router import BanList, Router


class NetworkClient:
    def __init__(self, initial_peers: list[str], run_id: str | None = None, *, hop_timeout: float = 20.0):
        if not initial_peers:
            raise ValueError("give at least one --initial-peers multiaddr")
        self.discovery = Discovery.start(initial_peers=initial_peers, client_mode=True,
                                         run_ids=[run_id] if run_id else [])
        self.loop: LoopThread | None = None
        try:
            self.run_id = self.discovery.resolve_run(run_id)
            self.discovery.follow_run(self.run_id)
            m = self.discovery.get_manifest(self.run_id)
            if m is None:
                raise RunNotFoundError(f"no run {self.run_id!r} found through {', '.join(initial_peers)}")
            self.manifest = m
            self.cfg = ModelConfig.from_dict(m.model_config_dict, source=f"manifest of run {self.run_id}")
            self.objective = get_objective(self.cfg)
            self.loop = LoopThread(name="bt-client")
            p2p = self.loop.run(self.discovery.dht.replicate_p2p(), timeout=30)
            self.hop_client = HopClient(p2p, self.run_id, loop=self.loop)
            self.bans = BanList()
            self.router = Router(self.discovery, self.hop_client, self.run_id, self.cfg.n_blocks,
                                 self.objective.state_dim(), hop_timeout=hop_timeout, bans=self.bans)
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
            errors = []
            for a in sorted((h for h in holders.get(b, []) if h.state == "online"), key=lambda h: -h.step):
                try:
                    meta, tensors = self.hop_client.get_block_state_sync(a.peer_id, b, timeout=timeout)
                except Exception as e:
                    errors.append(f"{a.peer_id}: {e}")
                    continue
                fresh = self.objective.build_block(b)
                fresh.load_state_dict(tensors)   # refuses wrong names/shapes
                ckpt.save_block(out / ckpt.block_filename(b), tensors, config=self.cfg, block_index=b,
                                step=int(meta.get("step", 0)), samples_seen=int(meta.get("samples_seen", 0)))
                got[b] = {"peer": a.peer_id, "step": int(meta.get("step", 0))}
                break
            else:
                raise RuntimeError(f"block {b} has no live holder that delivered its state"
                                   + (f" ({'; '.join(errors)})" if errors else ""))
        ckpt.save_config(out, self.cfg)
        return {"out": str(out), "blocks": got, "run_id": self.run_id, "config_hash": self.cfg.config_hash}

    def close(self) -> None:
        if self.loop is not None:
            self.loop.stop()
        self.discovery.shutdown(withdraw=False)
