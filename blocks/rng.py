"""The random state a forward starts from, and running code again from it: a recomputed forward
(the pipeline engine's ``--pipeline-recompute``, a checkpointed layer's backward) then draws the same
dropout masks as the forward it repeats, and the process gets its own random stream back afterwards."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def rng_state(device: torch.device) -> dict:
    """The CPU random state, and the device's on CUDA."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


@contextlib.contextmanager
def rng_restored(state: dict | None, device: torch.device) -> Iterator[None]:
    """Run the block inside from ``state``, then give the process its own random stream back.
    ``None``: the stream as it is (new masks)."""
    if state is None:
        yield
        return
    devices = [device] if "cuda" in state else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], device)
        yield
