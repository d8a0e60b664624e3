"""Peak memory of one averaging round: two replicas of a pipeline block (25.2M parameters, 96 MiB
of fp32 weights each) average in one process (hivemind in threads, the node's default), and the
process's high-water mark (VmHWM, reset to VmRSS through /proc/self/clear_refs just before the round)
is read above what it held before. Prints JSON: MiB above the start, per replica block size.

    python docs/records/s22/roundpeak.py [d_model [objective]]

(``paper``, a block-local objective, is judged by its held-out check loss: that round keeps a copy of
the weights sent and builds a probe block for the loss.)
"""
import json
import sys
import threading
import time

import numpy as np
import torch

from blocktrain.blocks.config import ModelConfig
from blocktrain.node.averaging.rounds import BlockAverager
from blocktrain.node.memory import tune_malloc
from blocktrain.node.trainer import BlockTrainer
from blocktrain.p2p.discovery import Discovery

tune_malloc()


def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])


d = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
objective = sys.argv[2] if len(sys.argv) > 2 else "pipeline"
cfg = ModelConfig(objective=objective, d_model=d, n_heads=8, layers_per_block=2, n_blocks=4, seq_len=32,
                  batch_size=2, target_dim=16)
data = np.frombuffer(bytes(range(256)) * 64, dtype=np.uint8)
first = Discovery.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"], run_ids=["peak"])
discs, avgs = [first], []
try:
    discs.append(Discovery.start(host_maddrs=["/ip4/127.0.0.1/tcp/0"], run_ids=["peak"],
                                 initial_peers=[str(a) for a in first.dht.get_visible_maddrs()]))
    gen = torch.Generator().manual_seed(0)
    for k, disc in enumerate(discs):
        t = BlockTrainer(cfg, 1, data, data)
        moved = [p.detach() + 0.01 * (k + 1) * torch.randn(p.shape, generator=gen) for p in t.module.parameters()]
        t.adopt_parameters(moved, step=0, samples_seen=0)
        del moved
        avgs.append(BlockAverager(disc.dht, t, "peak", peer_id=disc.peer_id, matchmaking_time=3.0))
    block_mib = sum(p.numel() * 4 for p in avgs[0].trainer.module.parameters()) / 2**20
    time.sleep(2)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS:")
    out = {}
    ths = [threading.Thread(target=lambda k=k: out.update({k: avgs[k].round()})) for k in (0, 1)]
    t0 = time.monotonic()
    for th in ths:
        th.start()
    for th in ths:
        th.join(120)
    peak = (kib("VmHWM:") - before) / 1024
    print(json.dumps({"objective": objective, "d_model": d, "block_mib": round(block_mib, 1), "round_peak_mib_two_replicas": round(peak, 1),
                      "per_replica_in_blocks": round(peak / 2 / block_mib, 2),
                      "accepted": [bool(out.get(k) and out[k].accepted) for k in (0, 1)],
                      "seconds": round(time.monotonic() - t0, 1)}))
finally:
    for a in avgs:
        a.shutdown()
    for disc in discs:
        disc.shutdown(withdraw=False)
