"""The ``bt-node`` command.

The node commands are imported here; the benchmark and offline commands only when invoked (or listed
by ``--help``): a node process then carries none of bench/ and its imports (issue 15, lean nodes:
BENCHMARKS.md). ``BT_EAGER_IMPORTS=cli`` imports them all up front, as before (for the bench's layouts).
"""
from __future__ import annotations

import atexit
import importlib
import os
import sys

import click

from .node_cmds import export, generate, join, seed, status
from .swarm_cmd import swarm


NODE_COMMANDS = ("seed", "join")   # the commands that run a node in this process (node/memory.py)


class LazyGroup(click.Group):
    """A click group whose ``lazy`` commands (name -> "module:attribute", relative to this package)
    are imported the first time click asks for them."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})
        if "cli" in {x.strip().lower() for x in os.environ.get("BT_EAGER_IMPORTS", "").split(",")}:
            for name in list(self.lazy):
                self.get_command(None, name)

    def list_commands(self, ctx):
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx, name):
        if name not in self.commands and name in self.lazy:
            module, attr = self.lazy.pop(name).split(":")
            self.add_command(getattr(importlib.import_module(module, __package__), attr), name)
        return self.commands.get(name)


@click.group(cls=LazyGroup, lazy={"train-local": ".local_cmds:train_local", "eval": ".local_cmds:eval_cmd"},
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="blocktrain")
@click.pass_context
def cli(ctx: click.Context):
    """BlockTrain node: train and serve one language model split into blocks, peer to peer.

    \b
    Examples:
      bt-node train-local --data ../shared/data/wikitext-2-raw --budget 90s
      bt-node eval --checkpoint runs/local --data ../shared/data/wikitext-2-raw
      bt-node bench quality --data ../shared/data/gutenberg --preset cpu --lr-sweep --out runs/v2
    """
    if ctx.invoked_subcommand in NODE_COMMANDS:   # before anything imports torch: a node runs no meta tensors
        from ..node.memory import import_torch_lean

        import_torch_lean()


@cli.group(cls=LazyGroup, lazy={
    "quality": ".quality_cmd:bench_quality", "memory": ".bench_resource_cmds:bench_memory_cmd",
    "throughput": ".bench_resource_cmds:bench_throughput_cmd",
    "node-memory": ".bench_resource_cmds:bench_node_memory_cmd", "swarm": ".bench_net_cmds:bench_swarm_cmd",
    "inference": ".bench_net_cmds:bench_inference_cmd", "compression": ".bench_net_cmds:bench_compression_cmd",
    "p2p": ".bench_net_cmds:bench_p2p_cmd", "simulate": ".bench_sim_cmd:bench_simulate_cmd",
    "pipeline": ".bench_pipeline_cmd:bench_pipeline_cmd",
    "pipeline-compare": ".bench_pipeline_cmd:bench_pipeline_compare_cmd",
    "pipeline-wall-reference": ".bench_pipeline_cmd:bench_pipeline_wall_reference_cmd"})
def bench():
    """Benchmarks that print a table (and JSON with --json)."""


cli.add_command(seed)
cli.add_command(join)
cli.add_command(generate)
cli.add_command(status)
cli.add_command(export)
cli.add_command(swarm)


def main() -> None:
    """The ``bt-node`` program. It ends with ``os._exit`` once the command and the exit handlers
    have run: the interpreter's own teardown (a full garbage collection of torch's and hivemind's
    modules) would add 2-5 s to every exit, and a node must be gone within 10 s of Ctrl-C."""
    try:
        cli(prog_name="bt-node")
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:   # sys.exit("message")
            print(e.code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    main()
