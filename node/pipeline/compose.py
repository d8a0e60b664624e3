"""Compose the pipeline engine on a node (its RPC service, its route to the next block) and read its totals."""
from __future__ import annotations

import asyncio

from blocktrain.node.pipeline.engine import PipelineEngine
from blocktrain.node.pipeline.settings import PipelineSettings
from blocktrain.node.routing.pipeline_route import NextStage
from blocktrain.p2p.pipeline_rpc import PipelineClient, PipelineServer, PipelineTraffic
from blocktrain.p2p.pipeline_wire import PipelineLimits

__all__ = ["start_pipeline", "pipeline_counters"]


def start_pipeline(node) -> PipelineEngine:
    """Build the engine of a started node (trainer, RPC loop, router up), register its ``rpc_train``
    service, and push their stops on the node's teardown. The node then runs ``engine.run`` as its
    train loop."""
    o, cfg, t = node.opts, node.cfg, node.trainer
    settings = PipelineSettings(inflight=o.pipeline_inflight, accumulate=o.pipeline_accumulate,
                                codec=o.pipeline_compression, timeout_s=o.pipeline_timeout,
                                timeout_max_s=o.pipeline_timeout_max,
                                weight_stash=o.pipeline_weight_stash, flush=o.pipeline_flush,
                                recompute=o.pipeline_recompute, layer_checkpoint=o.pipeline_layer_checkpoint)
    limits = PipelineLimits(allowed_blocks={node.block_index}, n_blocks=cfg.n_blocks,
                            mode=t.objective.chain_training, max_batch=max(64, cfg.batch_size),
                            max_seq=cfg.seq_len, d_model=t.objective.state_dim(), vocab_size=cfg.vocab_size)
    traffic = PipelineTraffic()
    next_stage = None
    if node.block_index < cfg.n_blocks - 1:
        client = PipelineClient(node.p2p, node.run_id, limits, traffic)

        async def holders(b: int, fresh: bool) -> list[str]:   # the DHT read blocks: off the event loop
            hs = await asyncio.get_running_loop().run_in_executor(None, node.router.holders, fresh)
            return [a.peer_id for a in hs.get(b, []) if a.state == "online" and a.serving]

        next_stage = NextStage(client, holders, mode=limits.mode, codec=settings.codec, self_peer=node.peer_id,
                               retries=settings.retries)
    engine = PipelineEngine(t, n_blocks=cfg.n_blocks, loop=node.loop, next_stage=next_stage, settings=settings,
                            self_peer=node.peer_id, on_step=node._after_step, idle=node._idle, traffic=traffic,
                            duty=node.duty)
    if next_stage is not None:
        next_stage.on_event = engine.stats.add
    server = PipelineServer(node.p2p, node.run_id, limits, engine.handle, traffic=traffic,
                            inject_delay_s=o.inject_delay_ms / 1000.0,
                            authorize=node.auth.authorize if node.auth.restricted else None)
    node.teardown.push("pipeline engine", engine.close, budget=2.0)
    node.loop.run(server.add_block(node.block_index), timeout=30)
    node.teardown.push("pipeline rpc", lambda: node.loop.run(server.close(), timeout=2.0), budget=2.5)
    return engine


def pipeline_counters(engine: PipelineEngine) -> dict[str, float]:
    """The engine's totals for /metrics (``pipeline_*``)."""
    st, tr = engine.stats.snapshot(), engine.traffic.snapshot()
    out = {f"pipeline_microbatches_{k}_total": st[k] for k in ("started", "completed", "received", "sent", "lost",
                                                                "retried", "refused_busy", "failed_calls")}
    out.update({f"pipeline_{k}_total": v for k, v in tr.items()})
    out.update(pipeline_stalled_seconds_total=st["stalled_s"], pipeline_steps_total=st["steps"],
               pipeline_microbatches_expired_in_queue_total=st["expired_in_queue"])
    if engine.b == 0 and not engine.last:   # block 0's adaptive budget per micro-batch (pipeline/budget.py)
        out["pipeline_microbatch_budget_seconds"] = engine.budget.current()
    return out
