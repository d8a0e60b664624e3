"""One status object per look at a node: what ``/v1/status``, ``/metrics``, the web page and the
CLI's progress line all read (``Node.snapshot()`` builds it; nothing else reads node internals)."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class NodeStatus:
    run: dict                 # run id, config hash, objective, shape, data and protocol
    self: dict                # this node: peer id, block, state, step, loss, addresses, uptime, upstream,
                              # pipeline (chain-trained runs: micro-batches, bytes, stalled time, memory)
    blocks: list[dict]        # per block: its announced holders
    losses: list[list]        # recent [time, step, loss]
    averaging: dict           # round counts, last verdict, traffic, history
    chain_ce: list[list]      # [time, held-out chain CE] measured through the network
    errors: list[str]
    counters: dict = field(default_factory=dict)   # totals for /metrics (bans, checkpoints, rpc bytes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("counters")
        return d

    def metrics(self) -> dict[str, float]:
        me, a = self.self, self.averaging
        m = {"step": float(me["step"]), "samples_seen_total": float(me["samples_seen"]),
             "throughput_samples_per_s": float(me["throughput"]),
             "loss": float(me["loss"]) if me["loss"] is not None else float("nan"),
             **{f"averaging_rounds_{k}_total": float(a[k])
                for k in ("attempted", "succeeded", "rejected", "failed", "partial")},
             "averaging_stalled_members_total": float(a["stalled_members"]),
             **{f"averaging_{k}_total": float(a[k])
                for k in ("bytes_sent", "bytes_received", "messages_sent", "messages_received")}}
        m.update({k: float(v) for k, v in self.counters.items()})
        return m


def build_status(node) -> NodeStatus:
    """Read a running node once (its trainer, averager, discovery and counters) into a NodeStatus."""
    cfg, t, a = node.cfg, node.trainer, node.averager
    holders = node.discovery.list_holders(node.run_id)
    blocks = [{"block": b, "holders": [
        {"peer_id": h.peer_id, "state": h.state, "step": h.step, "samples_seen": h.samples_seen,
         "throughput": h.throughput, "serving": h.serving, "loss": h.loss, "last_round_time": h.last_round_time,
         "is_self": h.peer_id == node.peer_id}
        for h in holders.get(b, [])]} for b in range(cfg.n_blocks)]
    s = a.stats
    traffic = a.traffic()
    counters = {"peers_banned_total": node.route_bans.total + a.bans.total,
                "checkpoints_written_total": node.checkpoints_written,
                "checkpoints_failed_total": node.checkpoints_failed,
                "dht_records_refused_total": sum(node.discovery.storage_refusals().values())}
    engine = getattr(node, "pipeline", None)
    if engine is not None:
        from blocktrain.node.pipeline.compose import pipeline_counters
        counters.update(pipeline_counters(engine))
    for side, counter in (("server", node.server.traffic), ("client", node.client.traffic)):
        snap = counter.snapshot()
        counters.update({f"rpc_{side}_bytes_sent_total": snap.bytes_sent,
                         f"rpc_{side}_bytes_received_total": snap.bytes_received,
                         f"rpc_{side}_calls_total": snap.calls, f"rpc_{side}_errors_total": snap.errors})
    return NodeStatus(
        run={"run_id": node.run_id, "address": node.run_address, "config_hash": cfg.config_hash, "objective": cfg.objective,
             "n_blocks": cfg.n_blocks, "d_model": cfg.d_model, "layers_per_block": cfg.layers_per_block,
             "seq_len": cfg.seq_len, "data": node.data_used, "protocol": node.split.protocol,
             "generate": node.generate_limits(),
             # this node's part in keeping the manifest joinable (Node._keep_manifest): last result and when
             "manifest": {"ttl_s": node.manifest.ttl_s, "signed": node.manifest.signature is not None,
                          **node.manifest_kept}},
        self={"peer_id": node.peer_id, "block": node.block_index, "state": node.state, "step": t.step,
              "samples_seen": t.samples_seen, "throughput": t.throughput(), "loss": t.recent_loss(),
              "lr": t.last_lr, "maddrs": node.discovery.visible_maddrs(), "uptime_s": time.time() - node.started_at,
              "checkpoint": {"dir": str(node.opts.checkpoint_dir), "written": node.checkpoints_written,
                             "failed": node.checkpoints_failed, "last": node.last_checkpoint,
                             "error": node.checkpoint_error},
              "resumed": node.resumed, "downloaded_state": node.downloaded is not None, "late_join": node.late_join,
              "http_port": node.http.port if node.http is not None else None,
              "reachability": node.reach.state,
              "train_duty": {"fraction": node.duty.fraction, "paused_s": round(node.duty.paused_s, 3)},
              # the training windows this node draws: (seed, stream) fix them (--seed, --data-stream)
              "data": {"seed": t.sampler.seed, "stream": t.sampler.worker_id,
                       "windows_drawn": t.sampler.windows_drawn},
              "upstream": node.upstream.status() if node.upstream is not None else None,
              "pipeline": engine.status() if engine is not None else None,
              "rebalance": node.rebalancer.status() if node.rebalancer is not None else {"enabled": False}},
        blocks=blocks,
        losses=[[round(ts, 3), st, round(lo, 5)] for ts, st, lo in list(t.losses)[-200:]],
        averaging={"attempted": s.attempted, "succeeded": s.succeeded, "rejected": s.rejected,
                   "failed": s.failed, "partial": s.partial, "skipped_alone": s.skipped_alone,
                   "stalled_members": s.stalled,
                   "last_completeness": s.last_completeness,
                   "last_round_time": s.last_round_time, "last_group_size": s.last_group_size,
                   "last_verdict": s.last_verdict, "compression": s.compression, **traffic,
                   "round_seconds": list(s.round_seconds[-20:]),
                   "round_started": [round(ts, 3) for ts in list(s.round_started)],
                   "history": [[round(ts, 3), g, ok, why] for ts, g, ok, why in list(s.history)]},
        chain_ce=[[round(ts, 3), ce] for ts, ce in node.chain_ce_history[-100:]],
        errors=node.errors[-10:],
        counters=counters)
