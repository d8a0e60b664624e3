"""The two references of ``bench pipeline`` (issue 13), each trained in its own fresh process.

* ``whole``: the whole-size model (``ReferenceLM`` of the chain's total depth) trained end to end
  on as many training windows as the ``pipeline`` network's block 0 sent through the chain
  (equal tokens, target 1);
* ``one_block``: a one-block-size ``ReferenceLM`` that one worker trains alone (target 2), scored
  when its own process CPU time reaches the CPU-seconds one ``pipeline`` worker used (the fair
  budget: a worker on a real network has its own machine), at the CPU-seconds of the network's
  curve points, and after the same wall time as each network (on the bench's shared machine).

A spawned child (one torch thread, like a worker) trains and scores the model on the bench's
held-out windows and reports its peak resident set (``VmHWM``, which, like a worker's, includes
the interpreter, torch and the training data) and that peak minus the resident set just before
the model was built (the training state proper: weights, gradients, optimizer, activations).
The child dies with the bench however the bench dies (a watchdog on the parent pid, the one the
node's hivemind children use: ``p2p/process.py``, which imports no hivemind); a SIGKILLed bench
otherwise left it training for its whole budget. Imports ``blocks`` and that watchdog, nothing of
the network.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from pathlib import Path

import torch

from blocktrain.p2p.process import watch_parent


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _child(q, parent: int, cfg_dict: dict, data: str, n_layers: int, seconds: float | None, windows_n: int | None,
           cpu_seconds: float | None, marks: list[float], eval_w: torch.Tensor, curve_w: torch.Tensor | None,
           device: str, seed: int, train_w: torch.Tensor | None = None, schedule: str = "constant") -> None:
    watch_parent(parent, lambda: os._exit(1))   # the bench SIGKILLed: leave at once (multiprocessing cannot see it)
    try:
        torch.set_num_threads(1)
        from blocktrain.blocks.config import ModelConfig
        from blocktrain.blocks.data import resolve_data
        from blocktrain.blocks.evaluate import evaluate_reference, per_window_reference_ce
        from blocktrain.blocks.reference import ReferenceLM
        from blocktrain.blocks.train import LrSchedule, make_optimizer, optimizer_step, reference_loss_fn
        from blocktrain.blocks.windows import WindowSampler

        cfg = ModelConfig.from_dict(cfg_dict, source="bench pipeline reference")
        split = resolve_data(data, seq_len=cfg.seq_len)
        dev = torch.device(device)
        torch.manual_seed(cfg.init_seed)
        rss0 = _rss_kib("VmRSS")
        model = ReferenceLM(cfg, n_layers=n_layers).to(dev)
        opt = make_optimizer(model, cfg)
        sampler = WindowSampler(split.train, cfg.seq_len, seed=seed, worker_id=100 + n_layers)
        # two clocks of training alone (scoring along the way is taken off both): wall and this process's CPU
        steps, t0, c0, off_wall, off_cpu = 0, time.time(), time.process_time(), 0.0, 0.0
        wall = lambda: time.time() - t0 - off_wall            # noqa: E731
        cpu = lambda: time.process_time() - c0 - off_cpu      # noqa: E731
        pending = sorted(m for m in marks if m > 0)
        sched = LrSchedule(cfg.lr, cfg.warmup_steps, schedule)
        lr = None   # the last step's rate

        def progress() -> float:
            """The fraction of this process's budget spent (a cosine decays over it): the wall time if
            given, else the windows, else the CPU time."""
            if seconds is not None:
                return wall() / seconds
            if windows_n is not None:
                return steps * cfg.batch_size / windows_n
            return cpu() / cpu_seconds
        curve, at_cpu, at_wall = [], None, None

        def snapshot(w: torch.Tensor, per_window: bool = True) -> dict:
            out = {"cpu_s": round(cpu(), 2), "wall_s": round(wall(), 2), "steps": steps,
                   "tokens": steps * cfg.batch_size * cfg.seq_len}
            return {**out, **score(w, per_window)}

        def score(w: torch.Tensor, per_window: bool) -> dict:
            """``ce`` on ``w``; on the held-out windows also each window's CE (``per_window``: the paired
            comparison with the chain, window by window)."""
            nonlocal off_wall, off_cpu
            tw, tc = time.time(), time.process_time()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            res = {"ce": evaluate_reference(model, w.to(dev))}
            if per_window:
                res["per_window"] = [round(float(x), 6) for x in per_window_reference_ce(model, w.to(dev))]
                if train_w is not None:   # the headline readings: also CE on windows of the training bytes
                    res["ce_train"] = evaluate_reference(model, train_w.to(dev))
            model.train()
            off_wall += time.time() - tw
            off_cpu += time.process_time() - tc
            return res

        while True:
            while pending and cpu() >= pending[0]:
                curve.append({"mark_cpu_s": pending.pop(0), **snapshot(curve_w if curve_w is not None else eval_w,
                                                                         per_window=False)})
            if cpu_seconds is not None and at_cpu is None and cpu() >= cpu_seconds:
                at_cpu = {"cpu_budget_s": cpu_seconds, **snapshot(eval_w)}
            if seconds is not None and at_wall is None and wall() >= seconds:
                at_wall = snapshot(eval_w)   # a loaded machine: the CPU budget may come after the wall time
            if ((seconds is None or at_wall is not None) and (windows_n is None or steps * cfg.batch_size >= windows_n)
                    and (cpu_seconds is None or at_cpu is not None) and not pending):
                break
            w = sampler.next_batch(cfg.batch_size).to(dev)
            lr = sched.at(steps, progress())
            optimizer_step(model, opt, cfg, steps, reference_loss_fn(model, w), lr=lr)
            steps += 1
        # the headline: at the wall-time budget if given, else the windows budget (the end), else the CPU budget
        end = at_wall or (snapshot(eval_w) if windows_n is not None or at_cpu is None else at_cpu)
        hwm = _rss_kib("VmHWM")
        q.put({"ce": end["ce"], "per_window": end["per_window"], "steps": end["steps"], "tokens": end["tokens"],
               **({"ce_train": end["ce_train"]} if "ce_train" in end else {}),
               "train_wall_s": round(end["wall_s"], 1), "train_cpu_s": round(end["cpu_s"], 1), "at_cpu": at_cpu,
               "lr_schedule": schedule, "lr_last": lr,
               "curve": curve, "n_layers": n_layers, "params": sum(p.numel() for p in model.parameters()),
               "peak_rss_mib": hwm / 1024, "training_state_rss_mib": (hwm - rss0) / 1024})
    except BaseException as e:   # noqa: BLE001 (reported to the parent, which raises it)
        q.put({"error": f"{type(e).__name__}: {e}"})


def train_reference(cfg_dict: dict, data: str, n_layers: int, eval_w: torch.Tensor, *,
                    seconds: float | None = None, windows_n: int | None = None, cpu_seconds: float | None = None,
                    marks: list[float] = (), curve_w: torch.Tensor | None = None, device: str = "cpu",
                    seed: int = 0, timeout: float | None = None, train_w: torch.Tensor | None = None,
                    schedule: str = "constant") -> dict:
    """Train one reference in a fresh process until every budget given is spent: ``seconds`` of training
    wall time, ``windows_n`` windows, ``cpu_seconds`` of its own process CPU time; scored on ``eval_w`` when
    each is reached (``ce``, ``steps``, ``train_wall_s``: at ``seconds`` if given, else at ``windows_n``, else
    at ``cpu_seconds``; ``at_cpu``: at ``cpu_seconds``), and on ``curve_w`` (else ``eval_w``) at each
    CPU-seconds mark of ``marks`` (``curve``); with ``train_w`` each headline reading also carries ``ce_train``
    (CE on windows of the training bytes). ``schedule``: ``constant`` after warm-up, or ``cosine`` to a tenth
    of the peak over the budget (the wall time if given, else the windows, else the CPU time; ``lr_last``: the
    last step's rate). Scoring is off both clocks. The wait lasts as long as the child lives (its budgets bound
    it; a fixed 3,600 s cut off an 80-minute wall-time reference), or ``timeout`` seconds if given."""
    if seconds is None and windows_n is None and cpu_seconds is None:
        raise ValueError("a reference needs a budget: seconds, windows or CPU seconds")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, os.getpid(), cfg_dict, data, n_layers, seconds, windows_n, cpu_seconds,
                                                  list(marks), eval_w, curve_w, device, seed, train_w, schedule),
                    daemon=True)
    p.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    res = None
    try:
        while True:
            try:
                res = q.get(timeout=2.0)
                break
            except queue.Empty:
                if not p.is_alive():   # its result, put just before it left, may still be on the way
                    try:
                        res = q.get(timeout=10.0)
                        break
                    except queue.Empty:
                        raise RuntimeError(f"reference ({n_layers} layers) exited with code {p.exitcode} "
                                           "before it reported") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"reference ({n_layers} layers) still training after {timeout:.0f}s")
    finally:
        p.join(timeout=30 if res is not None else 0)   # reported: it leaves by itself; else (timeout, ^C) at once
        if p.is_alive():
            p.kill()
            p.join()
    if "error" in res:
        raise RuntimeError(f"reference ({n_layers} layers) failed: {res['error']}")
    return res
