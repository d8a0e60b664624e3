"""bt-node train-local / eval: training and scoring without a network (``bench quality``: quality_cmd.py)."""
from __future__ import annotations

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from blocktrain.blocks.budget import Budget
from blocktrain.blocks.data import resolve_data
from blocktrain.blocks.device import pick_device
from blocktrain.blocks.evaluate import evaluate_checkpoint_dir
from blocktrain.blocks.local_run import LocalRun
from .config_opts import build_config, config_options
from .errors import friendly
from .render import emit_json, err_console, eval_table

DATA_HELP = ("Text source: a file, a folder of text files, a WikiText raw folder, or wikitext-2 / "
             "wikitext-103 (Hugging Face, needs a network).")


def data_options(fn):
    fn = click.option("--eval-data", default=None,
                      help="Held-out text (default: the source's test split, or its last 5%).")(fn)
    fn = click.option("--data", required=True, help=DATA_HELP)(fn)
    return fn


def train_with_progress(run: LocalRun, budget: Budget, quiet: bool) -> None:
    """Train ``run`` for ``budget`` with a progress bar on stderr (none when ``quiet``)."""
    if not quiet:
        err_console.print(f"[bold]data[/]: {run.split.description}  [bold]protocol[/]: {run.split.protocol}")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=err_console, disable=quiet, transient=True) as bar:
        what = f"{run.cfg.n_blocks} blocks" + (" + reference" if run.reference else "")
        task = bar.add_task(f"training {what}", total=1.0, info="")

        def on_round(r: LocalRun, frac: float) -> None:
            if r.rounds % 5 == 0 or frac >= 1.0:
                losses = " ".join(f"{t.name}:{t.last.get('loss', float('nan')):.3f}" for t in r.trainees)
                bar.update(task, completed=frac, info=f"round {r.rounds}  {losses}")

        run.train(budget, on_round)


@click.command("train-local")
@data_options
@config_options
@click.option("--budget", default="500steps", show_default=True,
              help="Training budget per block: '500steps' or a wall time like '90s', '5m'.")
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Save checkpoints here.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda or auto.")
@click.option("--seed", type=int, default=0, show_default=True, help="Data/noise sampling seed.")
@click.option("--k", "k", type=int, default=4, show_default=True, help="Chain samples averaged when scoring.")
@click.option("--eval-windows", type=int, default=64, show_default=True, help="Held-out windows scored.")
@click.option("--reference/--no-reference", default=True, show_default=True,
              help="Also train the end-to-end reference (one step per round, like each block).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@friendly
def train_local(data, eval_data, config_path, objective, overrides, budget, out, device, seed, k,
                eval_windows, reference, as_json):
    """Train all B blocks and the end-to-end reference locally, then score them on held-out text.

    \b
    Example:
      bt-node train-local --data ../shared/data/wikitext-2-raw --budget 90s --out runs/local
    """
    cfg = build_config(config_path, objective, overrides)
    budget = Budget.parse(budget)
    split = resolve_data(data, eval_data, seq_len=cfg.seq_len)
    run = LocalRun(cfg, split, pick_device(device), seed=seed, reference=reference)
    train_with_progress(run, budget, as_json)
    res = run.evaluate(n_windows=eval_windows, k=k)
    if out:
        run.save(out)
        res["checkpoint"] = str(out)
    report(res, as_json, "train-local")


@click.command("eval")
@click.option("--checkpoint", required=True, type=click.Path(file_okay=False),
              help="Directory written by train-local or export.")
@data_options
@click.option("--device", default="auto", show_default=True)
@click.option("--k", "k", type=int, default=4, show_default=True)
@click.option("--eval-windows", type=int, default=64, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@friendly
def eval_cmd(checkpoint, data, eval_data, device, k, eval_windows, as_json):
    """Score saved blocks (and a saved reference) on held-out text.

    \b
    Example:
      bt-node eval --checkpoint runs/local --data ../shared/data/wikitext-2-raw
    """
    split = resolve_data(data, eval_data)
    res = evaluate_checkpoint_dir(checkpoint, split, device=pick_device(device), k=k, n_windows=eval_windows)
    report(res, as_json, f"eval {checkpoint}")


def report(res: dict, as_json: bool, title: str) -> None:
    if as_json:
        emit_json(res)
    else:
        err_console.print(eval_table(res, title))
        click.echo(f"chain_ce={res['chain_ce']:.4f} ({res['ce_kind']}, K={res['chain_k']}) "
                   f"protocol={res['protocol']}")
