"""What the node's HTTP API (and ``bt-node generate``) asks of the node: generation, scoring and
status, computed by routing through the chain of live block holders."""
from __future__ import annotations

import time

from ..blocks.windows import eval_windows, text_windows
from . import generation


class NodeBackend:
    def __init__(self, node):
        self.node = node

    # -- generation and scoring -------------------------------------------------------------------
    def generate(self, prompt: bytes, max_bytes: int, mode: str, seed: int | None, temperature: float) -> dict:
        node = self.node
        out = generation.generate(node.trainer.objective, node.router, prompt, max_bytes, mode, seed=seed,
                                  temperature=temperature)
        out.pop("bytes")
        return out

    def score(self, text: bytes, k: int) -> dict:
        windows = text_windows(text, self.node.cfg.seq_len)
        res = generation.score(self.node.trainer.objective, self.node.router, windows, k)
        return {"ce": res["chain_ce"], "ce_kind": res["ce_kind"], "bytes_scored": res["tokens"], "k": res["k"],
                "route": res["route"]}

    def held_out_ce(self, n_windows: int = 16, k: int = 2) -> dict:
        node = self.node
        windows = eval_windows(node.split.eval, node.cfg.seq_len, n_windows)
        res = generation.score(node.trainer.objective, node.router, windows, k)
        node.chain_ce_history.append((time.time(), res["chain_ce"]))
        return res

    def average_now(self) -> dict:
        v = self.node.averager.round()
        if v is None:
            return {"accepted": None, "reason": self.node.averager.stats.last_failure}
        return {"accepted": v.accepted, "reason": v.reason, "relative_change": v.relative_change}

    # -- status ---------------------------------------------------------------------------------
    def status(self) -> dict:
        node = self.node
        cfg, t, a = node.cfg, node.trainer, node.averager
        holders = node.discovery.list_holders(node.run_id)
        blocks = []
        for b in range(cfg.n_blocks):
            blocks.append({"block": b, "holders": [
                {"peer_id": h.peer_id, "state": h.state, "step": h.step, "samples_seen": h.samples_seen,
                 "throughput": h.throughput, "load": h.load, "serving": h.serving, "loss": h.loss,
                 "last_round_time": h.last_round_time,
                 "is_self": h.peer_id == node.peer_id}
                for h in holders.get(b, [])]})
        s = a.stats
        return {
            "run": {"run_id": node.run_id, "config_hash": cfg.config_hash, "objective": cfg.objective,
                    "n_blocks": cfg.n_blocks, "d_model": cfg.d_model, "layers_per_block": cfg.layers_per_block,
                    "seq_len": cfg.seq_len, "data": node.data_used, "protocol": node.split.protocol},
            "self": {"peer_id": node.peer_id, "block": node.block_index, "state": node.state, "step": t.step,
                     "samples_seen": t.samples_seen, "throughput": t.throughput(), "loss": t.recent_loss(),
                     "maddrs": node.discovery.visible_maddrs(), "uptime_s": time.time() - node.started_at,
                     "resumed": node.resumed, "downloaded_state": node.downloaded is not None,
                     "upstream": self._upstream(t)},
            "blocks": blocks,
            "losses": [[round(ts, 3), st, round(l, 5)] for ts, st, l in list(t.losses)[-200:]],
            "averaging": {"attempted": s.attempted, "succeeded": s.succeeded, "rejected": s.rejected,
                          "failed": s.failed, "partial": s.partial, "last_completeness": s.last_completeness,
                          "last_round_time": s.last_round_time,
                          "last_group_size": s.last_group_size, "last_verdict": s.last_verdict,
                          "compression": s.compression, **a.traffic(),
                          "history": [[round(ts, 3), g, ok, why] for ts, g, ok, why in list(s.history)]},
            "chain_ce": [[round(ts, 3), ce] for ts, ce in node.chain_ce_history[-100:]],
            "errors": node.errors[-10:],
        }

    def _upstream(self, t) -> dict | None:
        """forward-chained: the snapshots of blocks < ours this worker trains on, and their cost."""
        if not t.objective.needs_upstream:
            return None
        now = time.time()
        snaps = [None if m is None else {"block": j, "peer": m.get("peer"), "step": m.get("step"),
                                         "age_s": round(now - m["fetched_at"], 1)}
                 for j, m in enumerate(t.upstream_meta)]
        return {"ready": t.upstream_ready(), "snapshots": snaps, "refresh_s": self.node.opts.upstream_refresh,
                **self.node.upstream_stats}

    def metrics(self) -> dict[str, float]:
        node = self.node
        t, s = node.trainer, node.averager.stats
        m = {"step": float(t.step), "samples_seen_total": float(t.samples_seen),
             "throughput_samples_per_s": t.throughput(), "loss": float(t.recent_loss() or float("nan")),
             "averaging_rounds_attempted_total": float(s.attempted),
             "averaging_rounds_succeeded_total": float(s.succeeded),
             "averaging_rounds_rejected_total": float(s.rejected),
             "averaging_rounds_failed_total": float(s.failed),
             "averaging_rounds_partial_total": float(s.partial),
             **{f"averaging_{k}_total": float(v) for k, v in node.averager.traffic().items()},
             "peers_banned_total": float(node.bans.total),
             "checkpoints_written_total": float(node.checkpoints_written)}
        for side, counter in (("server", getattr(node.server, "traffic", None)),
                              ("client", getattr(node.client, "traffic", None))):
            if counter is not None:
                snap = counter.snapshot()
                m[f"rpc_{side}_bytes_sent_total"] = float(snap.bytes_sent)
                m[f"rpc_{side}_bytes_received_total"] = float(snap.bytes_received)
                m[f"rpc_{side}_calls_total"] = float(snap.calls)
                m[f"rpc_{side}_errors_total"] = float(snap.errors)
        return m
