"""The two references of ``bench pipeline`` (issue 13), each trained in its own fresh process.

* ``whole``: the whole-size model (``ReferenceLM`` of the chain's total depth) trained end to end
  on as many training windows as the ``pipeline`` network's block 0 sent through the chain
  (equal tokens, target 1);
* ``one_block``: a one-block-size ``ReferenceLM`` that one worker trains alone in the same wall
  time as each network (target 2).

A spawned child (one torch thread, like a worker) trains and scores the model on the bench's
held-out windows and reports its peak resident set (``VmHWM``, which, like a worker's, includes
the interpreter, torch and the training data) and that peak minus the resident set just before
the model was built (the training state proper: weights, gradients, optimizer, activations).
Imports nothing of the network; only ``blocks``.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import torch


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _child(q, cfg_dict: dict, data: str, n_layers: int, seconds: float | None, windows_n: int | None,
           eval_w: torch.Tensor, device: str, seed: int) -> None:
    try:
        torch.set_num_threads(1)
        from blocktrain.blocks.config import ModelConfig
        from blocktrain.blocks.data import resolve_data
        from blocktrain.blocks.evaluate import evaluate_reference
        from blocktrain.blocks.reference import ReferenceLM
        from blocktrain.blocks.train import make_optimizer, optimizer_step, reference_loss_fn
        from blocktrain.blocks.windows import WindowSampler

        cfg = ModelConfig.from_dict(cfg_dict, source="bench pipeline reference")
        split = resolve_data(data, seq_len=cfg.seq_len)
        dev = torch.device(device)
        torch.manual_seed(cfg.init_seed)
        rss0 = _rss_kib("VmRSS")
        model = ReferenceLM(cfg, n_layers=n_layers).to(dev)
        opt = make_optimizer(model, cfg)
        sampler = WindowSampler(split.train, cfg.seq_len, seed=seed, worker_id=100 + n_layers)
        steps, t0 = 0, time.time()
        while True:
            if seconds is not None and time.time() - t0 >= seconds:
                break
            if windows_n is not None and steps * cfg.batch_size >= windows_n:
                break
            w = sampler.next_batch(cfg.batch_size).to(dev)
            optimizer_step(model, opt, cfg, steps, reference_loss_fn(model, w))
            steps += 1
        wall = time.time() - t0
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ce = evaluate_reference(model, eval_w.to(dev))
        hwm = _rss_kib("VmHWM")
        q.put({"ce": ce, "steps": steps, "tokens": steps * cfg.batch_size * cfg.seq_len, "train_wall_s": round(wall, 1),
               "n_layers": n_layers, "params": sum(p.numel() for p in model.parameters()),
               "peak_rss_mib": hwm / 1024, "training_state_rss_mib": (hwm - rss0) / 1024})
    except BaseException as e:   # noqa: BLE001 (reported to the parent, which raises it)
        q.put({"error": f"{type(e).__name__}: {e}"})


def train_reference(cfg_dict: dict, data: str, n_layers: int, eval_w: torch.Tensor, *,
                    seconds: float | None = None, windows_n: int | None = None, device: str = "cpu",
                    seed: int = 0, timeout: float = 3600.0) -> dict:
    """Train one reference in a fresh process until ``seconds`` pass or ``windows_n`` windows are used."""
    if seconds is None and windows_n is None:
        raise ValueError("a reference needs a budget: seconds or windows")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, cfg_dict, data, n_layers, seconds, windows_n, eval_w, device, seed),
                    daemon=True)
    p.start()
    try:
        res = q.get(timeout=timeout)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()
    if "error" in res:
        raise RuntimeError(f"reference ({n_layers} layers) failed: {res['error']}")
    return res
