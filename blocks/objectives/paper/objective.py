"""The published objective (DiffusionBlocks, arXiv 2506.14202, as used by BlockTrain 2606.24722).

Continuous EDM diffusion of the NEXT byte's target embedding at every position. Block b sees
the clean context x_<=t and z_t = e(x_{t+1}) + sigma * eps with sigma drawn from its own range
of the truncated log-normal, and is trained with EDM-weighted cross entropy of x_{t+1}.

Denoiser output: exact EDM preconditioning D = c_skip z + c_out F(c_in z; c_noise) in target
space; next-byte logits read D against the fixed target table,
    logits_v = exp(s) * <D, e_v> / sigma_data^2 + bias_v,
with a learned scalar s and per-byte bias (the softmax of the posterior over bytes given D).
The chain's Euler step uses D. The loss weight is the EDM lambda(sigma), normalised to 1 at
the block's middle noise level so every block's loss reads in nats/byte.

Known weakness (measured, see BENCHMARKS.md): at low sigma a block can read the answer out of
z ("target leakage"), so the noise floor must stay high, and then the state passes almost
nothing between blocks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...chain import Hop, HopRequest, HopResult, ask_logits, euler_step, traverse
from ...config import ModelConfig
from ...device import autocast
from ...hop import LocalHop
from ...sampling import (generate_chunks, generate_in_one_traversal, mean_ce, mixture_nll, next_byte,
                         target_logp)
from ..base import Objective, ScoreResult
from .net import PaperBlock
from .schedule import NoiseSchedule, edm_loss_weight


def paper_step(block: PaperBlock, req: HopRequest) -> HopResult:
    """Hop math: denoise at sigma, one Euler step to sigma_next; the logits are read at sigma."""
    z, sigma, sigma_next = req.state.float(), req.sigma.float(), req.sigma_next.float()
    d, logits = block(z, sigma, req.context)
    z_next = euler_step(z, d.float(), sigma, sigma_next)
    return HopResult(z_next, logits.float() if req.want_logits else None)


class PaperObjective(Objective):
    name = "paper"
    ce_kind = "exact"

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.schedule = NoiseSchedule(cfg)
        self.sigmas = self.schedule.boundaries().float()
        mids = [self.schedule.sigma_at_mass(torch.tensor(sum(self.schedule.mass_range(b)) / 2))
                for b in range(cfg.n_blocks)]
        self._mid_weight = [float(edm_loss_weight(s, cfg.sigma_data)) for s in mids]

    def build_block(self, b: int) -> nn.Module:
        self.check_block(b)
        return PaperBlock(self.cfg)

    def local_loss(self, block, b, windows, generator=None, upstream=None):
        dev = windows.device
        ctx, y = windows[:, :-1], windows[:, 1:]
        n = windows.shape[0]
        sigma = self.schedule.sample(b, n, generator).to(dev)
        x0 = block.target(y)
        noise = torch.randn(x0.shape, generator=generator, device="cpu").to(dev)
        z = x0 + sigma.view(-1, 1, 1) * noise
        with autocast(dev):
            _, logits = block(z, sigma, ctx)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                             reduction="none").view(n, -1).mean(1)
        weight = edm_loss_weight(sigma, self.cfg.sigma_data) / self._mid_weight[b]
        loss = (weight * ce).mean()
        return loss, {"ce": float(ce.detach().mean()), "sigma_mean": float(sigma.mean())}

    def make_hop(self, block, b) -> Hop:
        return LocalHop(block, paper_step)

    def _start_state(self, n: int, t: int, generator, device) -> torch.Tensor:
        """Pure noise at sigma_max: the state the first hop receives."""
        eps = torch.randn(n, t, self.cfg.target_dim, generator=generator)
        return (eps * self.sigmas[0]).to(device)

    def _next_byte_logits(self, hops, ctx: torch.Tensor, generator) -> torch.Tensor:
        """One traversal from fresh noise: the last hop's next-byte logits at every position."""
        z = self._start_state(ctx.shape[0], ctx.shape[1], generator, ctx.device)
        return traverse(hops, self.sigmas, z, ctx)[1][-1]

    @torch.no_grad()
    def score(self, hops, windows, k=4, generator=None) -> ScoreResult:
        """``ce``: the K-sample average of the chain's predictive distribution; ``ce_k1``: one sample."""
        ctx, y = windows[:, :-1], windows[:, 1:]
        lp = torch.stack([target_logp(self._next_byte_logits(hops, ctx, generator), y) for _ in range(k)])
        return ScoreResult(ce=float(mixture_nll(lp).mean()), ce_k1=float(-lp.mean()), k=k, tokens=y.numel(),
                           ce_kind=self.ce_kind)

    @torch.no_grad()
    def score_per_window(self, hops, windows, k=4, seed=0, batch: int = 64):
        """:meth:`score` window by window (window i's generator seeded ``seed + i``), ``batch`` windows
        and their k samples in one traversal: each window's k start states are drawn from its own
        generator in the order ``score`` draws them, so the figures are the loop's (to float rounding
        of batched matmuls) at 1/(batch x k) of the hop calls."""
        self.check_hops(hops)
        n, t = windows.shape[0], windows.shape[1] - 1
        ces = []
        for s in range(0, n, batch):
            w = windows[s:s + batch]
            m = w.shape[0]
            eps = torch.stack([torch.cat([torch.randn(1, t, self.cfg.target_dim, generator=g) for _ in range(k)])
                               for g in (torch.Generator().manual_seed(seed + s + i) for i in range(m))])
            z = (eps.reshape(m * k, t, -1) * self.sigmas[0]).to(w.device)
            ctx, y = w[:, :-1].repeat_interleave(k, 0), w[:, 1:].repeat_interleave(k, 0)
            lp = target_logp(traverse(hops, self.sigmas, z, ctx)[1][-1], y).view(m, k, t).transpose(0, 1)
            ces.extend(mixture_nll(lp).mean(1).tolist())
        return ces, [{} for _ in ces]

    @torch.no_grad()
    def block_alone_ce(self, block, b, windows, generator=None) -> float:
        """Block b from pure noise at its own top level sigma_b."""
        ctx, y = windows[:, :-1], windows[:, 1:]
        sigma = self.sigmas[b].expand(ctx.shape[0]).to(windows.device)
        z = torch.randn(*ctx.shape, self.cfg.target_dim, generator=generator).to(windows.device)
        hop = self.make_hop(block, b)
        return mean_ce(ask_logits(hop, HopRequest(z * sigma.view(-1, 1, 1), ctx, sigma, sigma), b).logits, y)

    def generate_limit(self, mode: str) -> int:
        """One sweep writes the whole continuation into one window: at most seq_len - 1 bytes."""
        limit = super().generate_limit(mode)
        return min(limit, self.cfg.seq_len - 1) if mode == "one_sweep" else limit

    @torch.no_grad()
    def generate_one_sweep(self, hops, prompt, n_bytes, *, temperature=0.0, generator=None) -> bytes:
        return generate_in_one_traversal(
            hops, prompt, n_bytes, seq_len=self.cfg.seq_len, levels=self.sigmas, temperature=temperature,
            generator=generator, start_state=lambda t: self._start_state(1, t, generator, "cpu"))

    @torch.no_grad()
    def generate_autoregressive(self, hops, prompt, n_bytes, *, temperature=0.0, generator=None) -> bytes:
        emit = next_byte(lambda ctx: self._next_byte_logits(hops, ctx, generator), temperature, generator)
        return generate_chunks(prompt, n_bytes, chunk_len=1, seq_len=self.cfg.seq_len, emit=emit)
