"""bt-node bench memory / throughput / node-memory: what one worker pays to train one block vs the
reference, and what one real node costs beyond its block's tensors."""
from __future__ import annotations

import json

import click
from rich.table import Table

from blocktrain.bench.node_memory import KINDS, LAYOUTS, bench_node_memory
from blocktrain.bench.resources import TINY_OVERRIDES, bench_memory, bench_throughput
from blocktrain.blocks.device import pick_device
from .config_opts import build_config, config_options
from .errors import friendly
from .render import emit_json, err_console


def _config(config_path, objective, overrides, tiny):
    if tiny:  # the tiny shape first, so an explicit --set still wins
        overrides = tuple(f"{k}={json.dumps(v)}" for k, v in TINY_OVERRIDES.items()) + tuple(overrides)
    return build_config(config_path, objective, overrides)


def _f(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def _shape(res: dict) -> str:
    c = res["config"]
    return (f"{res['device']} ({res['device_name']}), objective {c['objective']}, B={c['n_blocks']} x "
            f"{c['layers_per_block']} layers, d={c['d_model']}, batch {res['batch_size']}x{res['seq_len']}")


def memory_table(res: dict) -> Table:
    t = Table(title=f"bench memory: one block vs end-to-end reference ({res['steps']} AdamW steps)")
    t.add_column("")
    t.add_column("block", justify="right")
    t.add_column("reference", justify="right")
    t.add_column("block / ref", justify="right")
    b, r = res["block"], res["reference"]
    t.add_row("layers", str(b["layers"]), str(r["layers"]), "")
    t.add_row("parameters", f"{b['params']:,}", f"{r['params']:,}", _f(b["params"] / r["params"], ".3f"))
    t.add_row("weights+grads+AdamW (MiB, 16 B/param)", _f(b["param_grad_adam_mib"]),
              _f(r["param_grad_adam_mib"]), _f(res["ratio_param_grad_adam"], ".3f"))
    t.add_row("baseline RSS (MiB)", _f(b["baseline_rss_mib"]), _f(r["baseline_rss_mib"]), "")
    t.add_row("peak RSS, whole process (MiB)", _f(b["peak_rss_mib"]), _f(r["peak_rss_mib"]),
              _f(res["ratio_peak_rss"], ".3f"))
    t.add_row("peak RSS above baseline (MiB)", _f(b["peak_increase_mib"]), _f(r["peak_increase_mib"]),
              _f(res["ratio_peak_increase"], ".3f"))
    if res.get("ratio_live_tensors") is not None:
        t.add_row("live tensors, peak during a step (MiB)", _f(b["live_peak_mib"]), _f(r["live_peak_mib"]),
                  _f(res["ratio_live_tensors"], ".3f"))
    if "glibc_mmap" in res:
        g = res["glibc_mmap"]
        t.add_row(f"peak RSS above baseline, {g['env']} (MiB)", _f(g["block"]["peak_increase_mib"]),
                  _f(g["reference"]["peak_increase_mib"]), _f(g["ratio_peak_increase"], ".3f"))
    if "ratio_cuda_max_allocated" in res:
        t.add_row("CUDA max allocated (MiB)", _f(b.get("cuda_max_allocated_mib")),
                  _f(r.get("cuda_max_allocated_mib")), _f(res["ratio_cuda_max_allocated"], ".3f"))
    verdict = "meets" if res["meets_target"] else "misses"
    t.caption = (f"{_shape(res)}. Headline ratio ({res['ratio_kind']}) {_f(res['ratio'], '.3f')} "
                 f"{verdict} the target <= {res['target_ratio']}. Method: {res['method']}.")
    return t


def throughput_table(res: dict) -> Table:
    t = Table(title=f"bench throughput: one block step vs one reference step (median of {res['iters']})")
    t.add_column("")
    t.add_column("block", justify="right")
    t.add_column("reference", justify="right")
    t.add_column("block / ref", justify="right")
    b, r = res["block"], res["reference"]
    t.add_row("layers", str(b["layers"]), str(r["layers"]), "")
    t.add_row("model GFLOP per step", _f(b["flops_per_step"] / 1e9, ".2f"), _f(r["flops_per_step"] / 1e9, ".2f"),
              _f(1.0 / res["flops_ratio"], ".3f"))
    t.add_row("step time, median (ms)", _f(b["step_s_median"] * 1e3), _f(r["step_s_median"] * 1e3),
              _f(b["step_s_median"] / r["step_s_median"], ".3f"))
    t.add_row("step time, min..max (ms)", f"{b['step_s_min'] * 1e3:.0f}..{b['step_s_max'] * 1e3:.0f}",
              f"{r['step_s_min'] * 1e3:.0f}..{r['step_s_max'] * 1e3:.0f}", "")
    t.add_row("tokens/s (median step)", _f(b["tokens_per_s"], ",.0f"), _f(r["tokens_per_s"], ",.0f"),
              _f(res["ratio"], ".2f"))
    t.add_row("ratio: median of back-to-back pairs / of fastest steps", "", "",
              f"{res['ratio_paired_median']:.2f} / {res['ratio_best']:.2f}")
    t.add_row("achieved TFLOP/s", _f(b["achieved_tflops"], ".3f"), _f(r["achieved_tflops"], ".3f"), "")
    if res.get("peak_tflops"):
        t.add_row("MFU", _f(b["mfu"] and b["mfu"] * 100, ".2f") + " %", _f(r["mfu"] and r["mfu"] * 100, ".2f") + " %", "")
    verdict = "meets" if res["meets_target"] else "misses"
    cap = (f"{_shape(res)}, {res['threads']} threads. Throughput ratio {res['ratio']:.2f} {verdict} the "
           f"target >= {res['target_ratio']:g} (FLOPs ratio, the ideal: {res['flops_ratio']:.2f}).")
    if res.get("peak_source"):
        cap += f" Peak: {res['peak_source']}."
    t.caption = cap
    return t


@click.command("memory")
@config_options
@click.option("--steps", type=int, default=None, help="AdamW steps trained per measurement [default: 5; 3 with --tiny].")
@click.option("--block", "block_index", type=int, default=0, show_default=True, help="Which block to measure.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda or auto.")
@click.option("--threads", type=int, default=None,
              help="CPU threads for torch [default: torch's own choice; 1 with --tiny].")
@click.option("--glibc-mmap", is_flag=True,
              help="CPU: measure again with MALLOC_MMAP_THRESHOLD_=65536, so RSS tracks live tensors "
                   "rather than glibc's caching of freed memory.")
@click.option("--inflight", type=click.IntRange(1, 4096), default=1, show_default=True,
              help="pipeline / forward-streamed blocks: micro-batches in flight (a pipeline block before the last "
                   "holds their graphs and, with weight stashing, a weight copy each).")
@click.option("--recompute", is_flag=True,
              help="pipeline blocks: measure the engine's --pipeline-recompute (held micro-batches keep their inputs, "
                   "not their graphs; each backward runs its forward again).")
@click.option("--weight-stash/--no-weight-stash", default=True, show_default=True,
              help="pipeline blocks: a weight copy per held micro-batch (weight stashing, the worst case); "
                   "--no-weight-stash: none, as the engine runs by default and in flushed windows.")
@click.option("--layer-checkpoint", is_flag=True,
              help="pipeline blocks: measure the engine's --pipeline-layer-checkpoint (every forward with a graph "
                   "keeps each layer's input only; the backward runs each layer again).")
@click.option("--reference-layer-checkpoint", is_flag=True,
              help="The whole-size reference checkpointed per layer too (the like-for-like comparison).")
@click.option("--allocator", type=click.Choice(["node", "glibc"]), default="node", show_default=True,
              help="C allocator settings of both processes: node = what a node applies at start (trim threshold "
                   "64 KiB, mmap threshold 4 MiB, a trim every 10 s); glibc = its defaults.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0, 86400, min_open=True), default=900, show_default=True,
              help="Seconds each measurement's process may take (a model of hundreds of millions of parameters "
                   "needs more on a CPU).")
@click.option("--tiny", is_flag=True, help="A tiny shape (B=4, 2 layers, d=64, batch 8x64, 1 thread), well under a minute.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@friendly
def bench_memory_cmd(config_path, objective, overrides, steps, block_index, device, threads, glibc_mmap, inflight,
                     recompute, weight_stash, layer_checkpoint, reference_layer_checkpoint, allocator, timeout_s, tiny,
                     as_json):
    """Peak training memory of ONE block vs the end-to-end reference (B x layers_per_block layers).

    \b
    Each is trained for --steps AdamW steps at the same batch and seq_len in a fresh process.
    CPU: peak bytes of live tensors (the headline; allocator events), peak RSS of the whole
    process and peak RSS above a warm-runtime baseline; CUDA: torch.cuda.max_memory_allocated.
    Example:
      bt-node bench memory --json
    """
    cfg = _config(config_path, objective, overrides, tiny)
    steps = (3 if tiny else 5) if steps is None else steps
    threads = (1 if tiny else None) if threads is None else threads
    res = bench_memory(cfg, pick_device(device), steps=steps, block_index=block_index, threads=threads,
                       timeout=timeout_s, glibc_mmap=glibc_mmap, inflight=inflight, recompute=recompute,
                       weight_stash=weight_stash, allocator=allocator, layer_checkpoint=layer_checkpoint,
                       reference_layer_checkpoint=reference_layer_checkpoint)
    if as_json:
        emit_json(res)
    else:
        err_console.print(memory_table(res))
        click.echo(f"memory ratio block/reference = {res['ratio']:.3f} ({res['ratio_kind']})")


@click.command("throughput")
@config_options
@click.option("--warmup", type=int, default=None, help="Untimed steps of each first [default: 3; 2 with --tiny].")
@click.option("--iters", type=int, default=None, help="Timed steps of each, median taken [default: 10; 6 with --tiny].")
@click.option("--block", "block_index", type=int, default=0, show_default=True, help="Which block to time.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda or auto.")
@click.option("--peak-tflops", type=float, default=None,
              help="Device peak for MFU (default: an assumed dense bf16 peak by CUDA device name).")
@click.option("--threads", type=int, default=None,
              help="CPU threads for torch [default: torch's own choice; 1 with --tiny].")
@click.option("--tiny", is_flag=True, help="A tiny shape (B=4, 2 layers, d=64, batch 8x64, 1 thread), well under a minute.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@friendly
def bench_throughput_cmd(config_path, objective, overrides, warmup, iters, block_index, device, peak_tflops,
                         threads, tiny, as_json):
    """Tokens/s of ONE block's optimizer step vs one end-to-end reference step, same batch.

    \b
    Interleaved in one process after warm-up; median of --iters. On CUDA also MFU against an
    assumed device peak.
    Example:
      bt-node bench throughput --json
    """
    cfg = _config(config_path, objective, overrides, tiny)
    warmup = (2 if tiny else 3) if warmup is None else warmup
    iters = (6 if tiny else 10) if iters is None else iters
    threads = (1 if tiny else None) if threads is None else threads
    res = bench_throughput(cfg, pick_device(device), warmup=warmup, iters=iters, block_index=block_index,
                           peak_tflops=peak_tflops, threads=threads)
    if as_json:
        emit_json(res)
    else:
        err_console.print(throughput_table(res))
        click.echo(f"throughput ratio block/reference = {res['ratio']:.2f}")


def node_memory_table(res: dict) -> Table:
    runs = res["runs"]
    t = Table(title="bench node-memory: one real node's RSS (MB) per process, median of readings")
    t.add_column("process")
    for r in runs:
        t.add_column(r["layout"], justify="right")
    for kind in KINDS:
        if any(r["per_kind"][kind]["processes"] for r in runs):
            t.add_row(kind, *[_f(r["per_kind"][kind]["rss_mb"]) if r["per_kind"][kind]["processes"] else "-"
                              for r in runs])
    t.add_row("total RSS (judged)", *[_f(r["total_rss_mb"]) for r in runs])
    t.add_row("  anonymous / file", *[f"{r['total_rss_anon_mb']:.1f} / {r['total_rss_file_mb']:.1f}" for r in runs])
    t.add_row("alone (distinct pages)", *["-" if r["total_alone_mb"] is None else _f(r["total_alone_mb"])
                                          for r in runs])
    t.add_row("PSS / USS (shared-page dependent)", *[f"{r['total_pss_mb']:.1f} / {r['total_uss_mb']:.1f}"
                                                     for r in runs])
    t.add_row("block tensors", *[_f(r["tensors_mb"], ".2f") for r in runs])
    t.add_row("overhead (RSS - tensors)", *[_f(r["overhead_mb"]) for r in runs])
    t.add_row(f"<= {res['target_overhead_mb']:.0f} MB", *["met" if r["meets_target"] else "NOT met" for r in runs])
    t.caption = "; ".join(f"{r['layout']}: {r['what']}" for r in runs)
    return t


@click.command("node-memory")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Config field of the measured node's run, after the tiny shape (B=4, 2 layers, d=64).")
@click.option("--layout", "layouts", multiple=True, type=click.Choice(list(LAYOUTS)),
              help="Layouts to measure, one node each, in order [default: before, after].")
@click.option("--data", default=None, help="The node's --data [default: the node's own default].")
@click.option("--settle", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds the node trains after it is ready, before the readings.")
@click.option("--samples", type=click.IntRange(min=1), default=5, show_default=True, help="Readings per layout.")
@click.option("--interval", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="Seconds between readings.")
@click.option("--http/--no-http", default=True, show_default=True,
              help="Start the node with its HTTP API (--http-port 0) or without (a node's default).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@friendly
def bench_node_memory_cmd(overrides, layouts, data, settle, samples, interval, http, as_json):
    """Memory of ONE real node (seed, block 0, 127.0.0.1) per process, and its overhead beyond its
    block's own tensors, for each layout of hivemind's DHT and averager loops.

    \b
    RSS per process (main, DHT, averager, p2pd, torch_shm_manager), the block's tensors (params,
    grads, AdamW moments; the averager's copy is resident during rounds only, which a lone node never
    runs) and overhead = total RSS - tensors, against 300 MB
    (RSS does not depend on what else runs; PSS and USS, also given, fall as other processes
    share libtorch's pages; "alone" counts the node's distinct physical pages, root only).
    Example:
      bt-node bench node-memory --layout before --layout after
    """
    overrides = tuple(f"{k}={json.dumps(v)}" for k, v in TINY_OVERRIDES.items()) + tuple(overrides)
    cfg = build_config(None, None, overrides)
    res = bench_node_memory(cfg, list(overrides), list(layouts) or ["before", "after"], data=data,
                            settle_s=settle, samples=samples, interval_s=interval, http=http)
    if as_json:
        emit_json(res)
    else:
        err_console.print(node_memory_table(res))
        for r in res["runs"]:
            click.echo(f"{r['layout']}: overhead {r['overhead_mb']:.1f} MB "
                       f"({'meets' if r['meets_target'] else 'does NOT meet'} the {res['target_overhead_mb']:.0f} MB target)")
