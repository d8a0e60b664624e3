"""What a node is told to do (from the CLI or a test), validated in one place."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..blocks.config import ModelConfig

# What a NEW run trains when its seeder names no objective (`bt-node seed`, `bt-node swarm`): the one
# with the best held-out CE per wall-clock second on a local network (issue 13, target 5; BENCHMARKS
# "Training along the chain"). The config's own default (``ModelConfig.objective``, ``paper``) stays
# the default of offline training, the benchmarks and the library launcher (``LocalSwarm``).
NEW_RUN_OBJECTIVE = "pipeline"

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
MAX_SEED = 2**31 - 1      # --seed
MAX_STREAM = 2**32 - 1    # --data-stream (the default, from the peer id, is in the same range)


@dataclass
class NodeOptions:
    checkpoint_dir: Path
    run_id: str | None = None
    seeder: str | None = None                  # join: believe only manifests signed by this peer id
    initial_peers: list[str] = field(default_factory=list)
    config: ModelConfig | None = None          # seed only: the run's model config
    data: str | None = None                    # seed: the run's data spec; join: local override
    block: int | None = None
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 0
    announce_host: str | None = None
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    average_every: int = 20                    # local steps between averaging rounds
    average_period: float = 10.0               # seconds between rounds while not training
    average_clock: float = 60.0                # also a round once per this many UTC s (block's instant); 0: off
    checkpoint_every: int = 100
    eval_every: float = 0.0                    # seconds between held-out chain CE measurements (0: off)
    max_steps: int | None = None               # stop training after this many local steps (serve on)
    train: bool = True
    train_duty: float = 1.0                    # fraction of wall time the node's own training may use (0, 1]
    seed: int = 0                              # --seed: with the data stream, which windows this node draws
    data_stream: int | None = None             # --data-stream: this node's window stream (None: from its peer id)
    ttl: float = 30.0                          # --announce-ttl: DHT announcement lifetime, refreshed every ttl/3
    lr_decay_seconds: float | None = None      # --lr-decay-seconds: cosine decay over this much training (benchmarks)
    allowed_peers: frozenset[str] | None = None    # private run: only these peer ids may call / average
    run_secret_file: Path | None = None            # private run: secret folded into the averaging prefix
    operator_token_file: Path | None = None        # HTTP operator actions from non-local clients need this token
    averaging_compression: str = "fp32"        # fp32 | fp16 | 8bit: what the all-reduce sends
    inject_delay_ms: float = 0.0               # benchmark/testing knob: one-way delay per hop RPC
    upstream_refresh: float = 30.0             # forward-chained: seconds between snapshot refreshes of blocks < b
    # chain-trained runs (pipeline, forward-streamed): the pipeline engine (node/pipeline/engine.py)
    pipeline_inflight: int = 1                 # micro-batches a block-0 holder keeps in flight
    pipeline_accumulate: int = 1               # micro-batches per optimizer step
    pipeline_compression: str = "fp32"         # fp32 | fp16 | 8bit: activations and gradients sent
    pipeline_timeout: float = 60.0             # seconds a micro-batch may take, block 0 and back (at first;
    pipeline_timeout_max: float = 600.0        # adaptive up to this: node/pipeline/budget.py)
    pipeline_weight_stash: bool = False        # backward on the weights its forward used (PipeDream)
    pipeline_flush: bool = False               # block 0: GPipe-style windows of `inflight` micro-batches
    pipeline_recompute: bool = False           # hold inputs, not graphs; the backward recomputes the forward
    pipeline_layer_checkpoint: bool = False    # graphs hold each layer's input only; the backward reruns the layer
    pipeline_loss_screen: float = 0.0          # nats/byte over the median loss trained on: refused (0: off)
    pipeline_check_rate: float = 0.0           # answers recomputed before their backward, besides firsts (0: off)
    rebalance: bool = True                     # move to a needier block (node/rebalance.py); False pins the block
    rebalance_dwell: float = 600.0             # seconds a block is held before the node may leave it
    state_sources: int = 2                     # holders whose states a late join or a move compares (state_fetch.py)
    manifest_ttl: float = 86400.0              # seed: seconds each store of the run's manifest lives in the DHT
    operator_token: bytes | None = field(default=None, init=False, repr=False)   # read once from the file

    def __post_init__(self) -> None:
        self.checkpoint_dir = Path(self.checkpoint_dir)
        if self.allowed_peers is not None:   # private runs (node/auth.py): clear errors up front
            from .auth import validate_peer_id
            self.allowed_peers = frozenset(validate_peer_id(p) for p in self.allowed_peers)
        if self.run_secret_file is not None:
            from .auth import load_secret
            self.run_secret_file = Path(self.run_secret_file)
            load_secret(self.run_secret_file)
        if self.operator_token_file is not None:   # read once, here: a bad file fails before anything starts
            from .http.operator import load_operator_token
            self.operator_token_file = Path(self.operator_token_file)
            self.operator_token = load_operator_token(self.operator_token_file)
        if self.run_id is not None and not RUN_ID_RE.match(self.run_id):
            raise ValueError(f"run id {self.run_id!r} must be 1-64 letters, digits, '_' or '-' "
                             "(no dots: it names DHT keys)")
        if self.block is not None and self.block < 0:
            raise ValueError(f"--block must be >= 0, got {self.block}")
        if self.device not in ("cpu", "cuda", "auto"):
            raise ValueError(f"--device must be cpu, cuda or auto, got {self.device!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be in [0, 65535], got {self.http_port}")
        if self.average_every < 1 or self.checkpoint_every < 1:
            raise ValueError("--average-every and --checkpoint-every must be >= 1")
        if not (0 <= self.average_clock < float("inf")):
            raise ValueError(f"--average-clock must be a number of seconds >= 0, got {self.average_clock}")
        if self.averaging_compression not in ("fp32", "fp16", "8bit"):
            raise ValueError(f"--averaging-compression must be fp32, fp16 or 8bit, got {self.averaging_compression!r}")
        if not 1.0 <= self.upstream_refresh <= 86_400.0:
            raise ValueError(f"--upstream-refresh must be in [1, 86400] seconds, got {self.upstream_refresh}")
        from .pipeline.settings import PipelineSettings   # the pipeline flags' checks live with the engine
        PipelineSettings(inflight=self.pipeline_inflight, accumulate=self.pipeline_accumulate,
                         codec=self.pipeline_compression, timeout_s=self.pipeline_timeout,
                         timeout_max_s=self.pipeline_timeout_max)
        from .loops import DutyCycle   # the duty cycle's check lives with it
        DutyCycle(self.train_duty)
        if self.lr_decay_seconds is not None and not 1.0 <= self.lr_decay_seconds <= 10_000_000.0:
            raise ValueError(f"--lr-decay-seconds must be in [1, 1e7] seconds, got {self.lr_decay_seconds}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"--seed must be in [0, {MAX_SEED}], got {self.seed}")
        if self.data_stream is not None and not 0 <= self.data_stream <= MAX_STREAM:
            raise ValueError(f"--data-stream must be in [0, {MAX_STREAM}], got {self.data_stream}")
        if not 6.0 <= self.ttl <= 3600.0:
            raise ValueError(f"--announce-ttl must be in [6, 3600] seconds, got {self.ttl}")
        if not 1 <= self.state_sources <= 16:
            raise ValueError(f"--state-sources must be in [1, 16], got {self.state_sources}")
        if not 10 <= self.manifest_ttl <= 30 * 86400:
            raise ValueError(f"--manifest-ttl must be in [10, 2592000] seconds, got {self.manifest_ttl}")
        if not 0.0 <= self.rebalance_dwell <= 86_400.0:
            raise ValueError(f"--rebalance-dwell must be in [0, 86400] seconds, got {self.rebalance_dwell}")
        if not 0.0 <= self.inject_delay_ms <= 10_000.0:
            raise ValueError(f"--inject-delay-ms must be in [0, 10000], got {self.inject_delay_ms}")
