"""Compose the pipeline engine on a node (its RPC service, its route to the next block), replace it when the
node moves to another block, and read its totals."""
from __future__ import annotations

import asyncio

from blocktrain.node.pipeline.admission import UpstreamGate
from blocktrain.node.pipeline.engine import STAGE_MARGIN_S, PipelineEngine
from blocktrain.node.pipeline.settings import PipelineSettings
from blocktrain.node.pipeline.stats import PipelineStats
from blocktrain.node.pipeline.verify import GradientCheck
from blocktrain.node.routing.pipeline_route import NextStage
from blocktrain.p2p.pipeline_rpc import PipelineClient, PipelineServer, PipelineTraffic
from blocktrain.p2p.pipeline_wire import PipelineLimits

__all__ = ["start_pipeline", "PreparedSwitch", "pipeline_counters"]

CHECK_FETCH_S = 10.0   # a gradient check's download of one block's state (node/pipeline/verify.py)


def _build(node, trainer, traffic: PipelineTraffic | None = None,
           stats: PipelineStats | None = None) -> tuple[PipelineEngine, PipelineServer]:
    """The engine of ``trainer``'s block on a started node (RPC loop, router up) and its RPC server,
    not yet registered."""
    o, cfg, b = node.opts, node.cfg, trainer.block_index
    settings = PipelineSettings(inflight=o.pipeline_inflight, accumulate=o.pipeline_accumulate,
                                codec=o.pipeline_compression, timeout_s=o.pipeline_timeout,
                                timeout_max_s=o.pipeline_timeout_max,
                                weight_stash=o.pipeline_weight_stash, flush=o.pipeline_flush,
                                recompute=o.pipeline_recompute, layer_checkpoint=o.pipeline_layer_checkpoint,
                                loss_screen=o.pipeline_loss_screen, check_rate=o.pipeline_check_rate)
    limits = PipelineLimits(allowed_blocks={b}, n_blocks=cfg.n_blocks,
                            mode=trainer.objective.chain_training, max_batch=max(64, cfg.batch_size),
                            max_seq=cfg.seq_len, d_model=trainer.objective.state_dim(), vocab_size=cfg.vocab_size)
    traffic = traffic or PipelineTraffic()
    next_stage = None
    if b < cfg.n_blocks - 1:
        client = PipelineClient(node.p2p, node.run_id, limits, traffic)

        async def holders(nb: int, fresh: bool) -> list[str]:   # the DHT read blocks: off the event loop
            hs = await asyncio.get_running_loop().run_in_executor(None, node.router.holders, fresh)
            return [a.peer_id for a in hs.get(nb, []) if a.state == "online" and a.serving]

        next_stage = NextStage(client, holders, mode=limits.mode, codec=settings.codec, self_peer=node.peer_id,
                               retries=settings.retries, n_blocks=cfg.n_blocks, stage_margin_s=STAGE_MARGIN_S)
    check = None
    if next_stage is not None and settings.check_rate > 0:
        async def fetch(peer: str, block: int):   # a route's block state, as any member may download it
            return (await node.client.get_block_state(peer, block, timeout=CHECK_FETCH_S))[1]
        check = GradientCheck(trainer.objective, b, cfg.n_blocks, fetch, rate=settings.check_rate)
    engine = PipelineEngine(trainer, n_blocks=cfg.n_blocks, loop=node.loop, next_stage=next_stage, settings=settings,
                            self_peer=node.peer_id, on_step=node._after_step, idle=node._idle, traffic=traffic,
                            duty=node.duty, stats=stats, check=check)
    if next_stage is not None:
        next_stage.on_event = engine.stats.add
    gate = upstream_gate(node, b, lambda: engine.stats.add("refused_not_upstream"))
    server = PipelineServer(node.p2p, node.run_id, limits, engine.handle, traffic=traffic,
                            inject_delay_s=o.inject_delay_ms / 1000.0,
                            authorize=node.auth.authorize if node.auth.restricted else None,
                            admit=gate.admit if gate is not None else None)
    return engine, server


def upstream_gate(node, block: int, on_refused) -> UpstreamGate | None:
    """Block ``block``'s stage serves only announced holders of the block before it (node/pipeline/admission.py);
    block 0 is sent nothing."""
    return UpstreamGate(block, node.router.holders, on_refused=on_refused) if block >= 1 else None


def start_pipeline(node) -> PipelineEngine:
    """Build the engine of the node's block, register its ``rpc_train`` service, and push the stops of
    whatever engine and service the node holds at teardown (a move replaces them). The node then runs
    ``node.pipeline.run`` as its train loop."""
    engine, server = _build(node, node.trainer)
    node.pipeline, node.pipeline_server = engine, server
    node.teardown.push("pipeline engine", lambda: node.pipeline.close(), budget=2.0)
    node.loop.run(server.add_block(node.block_index), timeout=30)
    node.teardown.push("pipeline rpc", lambda: node.loop.run(node.pipeline_server.close(), timeout=2.0), budget=2.5)
    return engine


class PreparedSwitch:
    """A rebalancing move's new engine, already serving its block's ``rpc_train`` (refusing until it
    runs): :meth:`commit` makes it the node's, :meth:`cancel` drops it. Nothing of the old block
    changes before ``commit``."""

    def __init__(self, node, trainer):
        self.node = node
        self.engine, self.server = _build(node, trainer, traffic=node.pipeline.traffic, stats=node.pipeline.stats)
        self.old: tuple[PipelineEngine, PipelineServer] | None = None   # the engine and service it replaced
        self.committed = False
        try:
            node.loop.run(self.server.add_block(trainer.block_index), timeout=30)
        except BaseException:
            self.cancel()
            raise

    def commit(self) -> None:
        """The node's train loop moves to the new engine (the old one's ``run`` returns); the old engine
        keeps its service up until :meth:`retire_old` (routers cache holder lists a few seconds)."""
        n = self.node
        self.old = (n.pipeline, n.pipeline_server)
        n.pipeline, n.pipeline_server = self.engine, self.server
        self.committed = True
        self.old[0].retire()

    def retire_old(self) -> None:
        if self.old is None:
            return
        engine, server = self.old
        self.old = None
        engine.close()
        self.node.loop.run(server.close(), timeout=5.0)

    def cancel(self) -> None:
        self.engine.close()
        self.node.loop.run(self.server.close(), timeout=5.0)


def pipeline_counters(engine: PipelineEngine) -> dict[str, float]:
    """The engine's totals for /metrics (``pipeline_*``)."""
    st, tr = engine.stats.snapshot(), engine.traffic.snapshot()
    out = {f"pipeline_microbatches_{k}_total": st[k] for k in ("started", "completed", "received", "sent", "lost",
                                                                "retried", "refused_busy", "refused_not_upstream",
                                                                "refused_outlier", "failed_calls",
                                                                "gradient_checks", "gradient_checks_failed")}
    out.update({f"pipeline_{k}_total": v for k, v in tr.items()})
    out.update(pipeline_stalled_seconds_total=st["stalled_s"], pipeline_steps_total=st["steps"],
               pipeline_microbatches_expired_in_queue_total=st["expired_in_queue"])
    if engine.b == 0 and not engine.last:   # block 0's adaptive budget per micro-batch (pipeline/budget.py)
        out["pipeline_microbatch_budget_seconds"] = engine.budget.current()
    return out
