"""TEST-ONLY hostile averaging peer: joins a run's DHT and pushes poisoned block weights into
averaging rounds of ``{run_id}_block{b}`` (the prefix honest BlockAveragers use), with the right
tensor shapes, config hash and gathered metadata, so only the *values* are hostile.

Run as a process; it speaks JSON lines (commands on stdin, one answer per command on stdout)::

    python tests/test_utils/hostile_averager.py --initial-peers MADDR --run-id R --block 0 --identities 3 \
        [--secret-file FILE --secret-identities 2]

    {"cmd": "round", "identity": 0, "mode": "nan", "timeout": 40}
        -> {"ok": true, "result": {"peer": ..., "completed": true, "group": [...], "attempts": n}}
    {"cmd": "download", "identity": 0, "timeout": 20}   (try hivemind's state download)
    {"cmd": "quit"}

Modes: nan, inf, scale1000 (honest-looking init weights x1000), random (unit Gaussian),
benign (the block's deterministic init weights, unchanged). ``--silent-identities I ...``: those identities
join groups and then send no tensor part and reduce none (a member that stalls every all-reduce it is in;
each gives up on its own step after 15 s and looks for the next group). ``--weight`` (default 1000) is the
averaging weight it claims: an attacker maximises its influence on the mean.
Each identity is a separate DHT node + averager with a fresh peer id (peer ids are free: bans by
peer id do not stop an attacker who keeps making new ones; see RELIABILITY.md).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
import traceback

import torch

from blocktrain.p2p.averager import STALLED_KEY   # in a round's gathered metadata, not a member

MODES = ("nan", "inf", "scale1000", "random", "benign")


def _reply(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Hostile:
    def __init__(self, args):
        from hivemind.compression import NoCompression

        from blocktrain.blocks.config import ModelConfig
        from blocktrain.blocks.objectives import get_objective
        from blocktrain.node.auth import RunAuth, load_secret
        # hivemind names the averager's RPC protocols after the servicer class, so a peer must use
        # a class of the same name to be understood at all; with no trainer and no policy set,
        # this class is plain hivemind (no acceptance checks, no bans: nothing guards this peer)
        from blocktrain.p2p.averager import BlockStateAverager as DecentralizedAverager
        from blocktrain.p2p.discovery import Discovery

        self.args = args
        first = Discovery.start(initial_peers=args.initial_peers, run_ids=[args.run_id])
        m = first.get_manifest(args.run_id)
        if m is None:
            raise RuntimeError(f"no manifest for run {args.run_id!r}")
        self.cfg = ModelConfig.from_dict(m.model_config_dict, source="manifest")
        torch.manual_seed(self.cfg.init_seed + args.block)
        module = get_objective(self.cfg).build_block(args.block)
        self.init = [p.detach().clone() for p in module.parameters()]
        secret = load_secret(args.secret_file) if args.secret_file else None
        self.public_prefix = RunAuth().averaging_prefix(args.run_id, args.block)
        self.secret_prefix = RunAuth(secret=secret).averaging_prefix(args.run_id, args.block)
        self.prefixes = [self.secret_prefix if i in args.secret_identities else self.public_prefix
                         for i in range(args.identities)]

        import asyncio

        async def _stall(self, group_info, min_vector_size, **kwargs):
            await asyncio.sleep(15.0)
            raise RuntimeError("silent: sent and reduced nothing")

        # the same protocol names (hivemind names them after the class), an all-reduce that never runs
        silent = type(DecentralizedAverager.__name__, (DecentralizedAverager,), {"_aggregate_with_group": _stall})

        def make(i):
            d = first if i == 0 else Discovery.start(initial_peers=args.initial_peers, run_ids=[args.run_id])
            cls = silent if i in args.silent_identities else DecentralizedAverager
            av = cls(
                averaged_tensors=[t.clone() for t in self.init], dht=d.dht, prefix=self.prefixes[i], start=True,
                target_group_size=4, min_group_size=2, min_matchmaking_time=3.0, request_timeout=1.5,
                compression=NoCompression(), allow_state_sharing=False, next_chunk_timeout=10.0,
                sender_timeout=5.0, reducer_timeout=10.0)
            return d, av

        self.ids = [make(i) for i in range(args.identities)]   # hivemind needs the main thread here

    def poison(self, mode: str) -> list[torch.Tensor]:
        if mode == "nan":
            return [torch.full_like(t, float("nan")) for t in self.init]
        if mode == "inf":
            return [torch.full_like(t, float("inf")) for t in self.init]
        if mode == "scale1000":
            return [t * 1000.0 for t in self.init]
        if mode == "random":
            return [torch.randn_like(t) for t in self.init]
        if mode == "benign":
            return [t.clone() for t in self.init]
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")

    def round(self, identity: int, mode: str, timeout: float) -> dict:
        d, av = self.ids[identity]
        values = self.poison(mode)
        me = str(d.peer_id)
        deadline = time.monotonic() + timeout
        attempts, errors = 0, []
        while time.monotonic() < deadline:
            attempts += 1
            with av.get_tensors() as shared:
                for s, v in zip(shared, values):
                    s.copy_(v)
            stamp = {"round": attempts, "step": 0, "peer": me, "config_hash": self.cfg.config_hash,
                     "n_tensors": len(values)}
            try:
                gathered = av.step(gather=stamp, weight=self.args.weight, timeout=12, allow_retries=False)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}"[:200])
                gathered = None
            if gathered:
                group = sorted(str(p) for p in gathered if p != STALLED_KEY)
                if any(p != me for p in group):
                    return {"peer": me, "completed": True, "group": group, "attempts": attempts, "mode": mode}
            time.sleep(0.2)
        return {"peer": me, "completed": False, "group": [], "attempts": attempts, "mode": mode,
                "errors": errors[-3:]}

    def download(self, identity: int, timeout: float) -> dict:
        d, av = self.ids[identity]
        got = av.load_state_from_peers(timeout=timeout)
        return {"peer": str(d.peer_id), "got_state": got is not None}

    def close(self) -> None:
        for d, av in self.ids:
            try:
                av.shutdown()
            except Exception:
                pass
            try:
                d.shutdown(withdraw=False)
            except Exception:
                pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--initial-peers", nargs="+", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--block", type=int, default=0)
    ap.add_argument("--identities", type=int, default=1)
    ap.add_argument("--weight", type=float, default=1000.0)
    ap.add_argument("--silent-identities", type=int, nargs="*", default=[],
                    help="these identities join groups, then send and reduce nothing")
    ap.add_argument("--secret-file", default=None, help="a leaked run secret, for --secret-identities")
    ap.add_argument("--secret-identities", type=int, nargs="*", default=[],
                    help="these identities fold the secret into their prefix (they found the private group)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("hivemind").setLevel(logging.CRITICAL)
    try:
        h = Hostile(args)
    except Exception as e:
        _reply({"event": "failed", "error": type(e).__name__, "message": str(e)})
        sys.exit(2)
    _reply({"event": "ready", "peers": [str(d.peer_id) for d, _ in h.ids], "prefixes": h.prefixes})
    lock = threading.Lock()
    try:
        for line in sys.stdin:
            try:
                cmd = json.loads(line)
                name = cmd.pop("cmd")
                if name == "quit":
                    break
                with lock:
                    result = getattr(h, name)(**cmd)
                _reply({"ok": True, "result": result})
            except Exception as e:
                _reply({"ok": False, "error": type(e).__name__, "message": str(e),
                        "trace": traceback.format_exc()[-800:]})
    finally:
        h.close()


if __name__ == "__main__":
    main()
