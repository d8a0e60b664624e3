"""A real ``bt-node`` whose pipeline engine records what it computes, for the gradient test.

    BT_PROBE_DIR=DIR [BT_PROBE_WINDOWS=FILE] [BT_PROBE_CODECS=fp32,fp16] python tests/test_utils/pipeline_probe.py seed|join ...

The node runs unchanged, but (test side, by wrapping engine methods):

* after every micro-batch whose gradients a stage accumulated, it saves the block's parameter
  gradients to ``DIR/grads-<i>.pt`` and zeroes them (so each file holds one micro-batch's);
* every answer a stage gives saves the gradient it answers with (dL/d its input) to
  ``DIR/answer-<i>.pt``, and each holder then switches what it sends next to the next codec of
  ``BT_PROBE_CODECS``;
* its stages serve any caller (no upstream gate: the test's own peer sends them raw messages);
* a holder of block 0 does not read data: it sends the windows saved in ``BT_PROBE_WINDOWS``, once
  per codec, one micro-batch at a time (each retried until the chain is complete), then idles.

The product has no probe knob; run it with ``--pipeline-accumulate`` large so no step moves the weights.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import torch


def install() -> None:
    from blocktrain.node.pipeline import engine as E
    from faulty_node import open_stages   # (run as a script: its folder is on sys.path)
    open_stages()   # the test's own peer sends a stage raw messages (tests/test_pipeline_grads.py)

    out = Path(os.environ["BT_PROBE_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    codecs = os.environ.get("BT_PROBE_CODECS", "fp32").split(",")
    counts = {"grads": 0, "answer": 0}
    lock = threading.Lock()

    def save(kind: str, obj) -> None:
        with lock:
            i = counts[kind]
            counts[kind] += 1
        torch.save(obj, out / f"{kind}-{i}.pt")

    def next_codec(self) -> None:
        if self.next is not None:
            self.next.codec = codecs[min(counts["answer"], len(codecs) - 1)]

    accumulated = E.PipelineEngine._accumulated

    def probe_accumulated(self, samples, loss, **kw):
        m = self.trainer.module
        save("grads", {n: p.grad.detach().cpu().clone() for n, p in m.named_parameters() if p.grad is not None})
        accumulated(self, samples, loss, **kw)
        m.zero_grad(set_to_none=True)

    handle = E.PipelineEngine.handle

    async def probe_handle(self, req):
        resp = await handle(self, req)
        save("answer", {"grad": resp.grad, "codec": req.codec, "loss": resp.loss, "route": resp.route})
        next_codec(self)
        return resp

    def probe_run(self, stop):
        self.accepting = True
        if self.b != 0:
            stop.wait()
            return
        windows = torch.load(os.environ["BT_PROBE_WINDOWS"])
        for codec in codecs:
            self.next.codec = codec
            done = self.stats.snapshot()["completed"]
            while not stop.is_set() and self.stats.snapshot()["completed"] == done:
                try:
                    self.loop.submit(self._microbatch(windows)).result(timeout=120)
                except Exception:
                    return
                stop.wait(1.0)
        stop.wait()

    E.PipelineEngine._accumulated = probe_accumulated
    E.PipelineEngine.handle = probe_handle
    E.PipelineEngine.run = probe_run


def main(argv: list[str]) -> None:
    install()
    from blocktrain.cli.main import main as bt_node
    sys.argv = ["bt-node", *argv]
    bt_node()


if __name__ == "__main__":
    main(sys.argv[1:])
