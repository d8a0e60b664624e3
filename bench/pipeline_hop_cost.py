"""What our code costs per pipeline hand-off: encode, protobuf and decode of one ``rpc_train`` call both ways.

``python -m blocktrain.bench.pipeline_hop_cost [--batch 8 --seq 288 --d-model 64 --codec fp32 --calls 200]``
runs, in one process and without a network, everything the two workers' Python does to a micro-batch's
state on its way to the next block and to the gradient on its way back (``request_message``, split
into parts, ``SerializeToString`` / ``FromString`` as hivemind's stream does, ``TensorAssembler``,
``decode_request``; the same for the answer) and prints CPU and wall milliseconds per call. The rest
of a hand-off's time (the two p2pd daemons, sockets, event-loop and thread wake-ups) is what the
engine's ``times_s`` show beyond it: a caller's ``call`` less its callee's ``serve``.
"""
from __future__ import annotations

import argparse
import time

import torch

from blocktrain.p2p.offline_wire import pipeline_call_round_trip
from blocktrain.p2p.pipeline_wire import PipelineLimits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=288)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--codec", choices=("fp32", "fp16", "8bit"), default="fp32")
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(1)
    lim = PipelineLimits(allowed_blocks={1}, n_blocks=4, mode="backprop", max_batch=max(64, a.batch),
                         max_seq=a.seq, d_model=a.d_model, vocab_size=256)
    h, y = torch.randn(a.batch, a.seq, a.d_model), torch.randint(0, 256, (a.batch, a.seq))
    for _ in range(5):
        pipeline_call_round_trip(h, y, a.codec, lim)
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(a.calls):
        pipeline_call_round_trip(h, y, a.codec, lim)
    cpu, wall = (time.process_time() - c0) / a.calls, (time.perf_counter() - w0) / a.calls
    print(f"{a.codec} state {tuple(h.shape)} ({h.numel() * 4 / 1e3:.0f} KB as fp32), one call both ways: "
          f"{cpu * 1e3:.2f} ms CPU, {wall * 1e3:.2f} ms wall (mean of {a.calls})")


if __name__ == "__main__":
    main()
