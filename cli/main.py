"""The ``bt-node`` command."""
from __future__ import annotations

import atexit
import os
import sys

import click

from .bench_resource_cmds import bench_memory_cmd, bench_node_memory_cmd, bench_throughput_cmd
from .bench_net_cmds import bench_compression_cmd, bench_inference_cmd, bench_p2p_cmd, bench_swarm_cmd
from .bench_pipeline_cmd import bench_pipeline_cmd
from .bench_sim_cmd import bench_simulate_cmd
from .local_cmds import eval_cmd, train_local
from .quality_cmd import bench_quality
from .node_cmds import export, generate, join, seed, status
from .swarm_cmd import swarm


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="blocktrain")
def cli():
    """BlockTrain node: train and serve one language model split into blocks, peer to peer.

    \b
    Examples:
      bt-node train-local --data ../shared/data/wikitext-2-raw --budget 90s
      bt-node eval --checkpoint runs/local --data ../shared/data/wikitext-2-raw
      bt-node bench quality --data ../shared/data/gutenberg --preset cpu --lr-sweep --out runs/v2
    """


@cli.group()
def bench():
    """Benchmarks that print a table (and JSON with --json)."""


cli.add_command(seed)
cli.add_command(join)
cli.add_command(generate)
cli.add_command(status)
cli.add_command(export)
cli.add_command(swarm)
cli.add_command(train_local)
cli.add_command(eval_cmd)
bench.add_command(bench_quality)
bench.add_command(bench_memory_cmd)
bench.add_command(bench_throughput_cmd)
bench.add_command(bench_node_memory_cmd)
bench.add_command(bench_swarm_cmd)
bench.add_command(bench_inference_cmd)
bench.add_command(bench_compression_cmd)
bench.add_command(bench_p2p_cmd)
bench.add_command(bench_simulate_cmd)
bench.add_command(bench_pipeline_cmd)


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
