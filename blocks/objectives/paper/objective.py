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

from ...chain import Hop, HopRequest, HopResult, euler_step, traverse
from ...config import ModelConfig
from ...device import autocast
from ...hop import LocalHop
from ..base import Objective, ScoreResult, sample_bytes
from ..common import prepare_prompt
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
        if not 0 <= b < self.cfg.n_blocks:
            raise IndexError(f"block index {b} out of range [0, {self.cfg.n_blocks})")
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
        eps = torch.randn(n, t, self.cfg.target_dim, generator=generator)
        return (eps * self.sigmas[0]).to(device)

    @torch.no_grad()
    def score(self, hops, windows, k=4, generator=None) -> ScoreResult:
        ctx, y = windows[:, :-1], windows[:, 1:]
        n, t = ctx.shape
        logps = []
        for _ in range(k):
            z = self._start_state(n, t, generator, windows.device)
            _, logits = traverse(hops, self.sigmas, z, ctx)
            logps.append(torch.log_softmax(logits.float(), -1).gather(-1, y.unsqueeze(-1)).squeeze(-1))
        lp = torch.stack(logps)                       # (K, N, T)
        ce_k1 = float(-lp.mean())
        ce = float(-(torch.logsumexp(lp, 0) - torch.log(torch.tensor(float(k)))).mean())
        return ScoreResult(ce=ce, ce_k1=ce_k1, k=k, tokens=n * t, ce_kind=self.ce_kind)

    @torch.no_grad()
    def block_alone_ce(self, block, b, windows, generator=None) -> float:
        ctx, y = windows[:, :-1], windows[:, 1:]
        n, t = ctx.shape
        dev = next(block.parameters()).device
        sigma = self.sigmas[b].expand(n).to(dev)
        z = (torch.randn(n, t, self.cfg.target_dim, generator=generator).to(dev) * sigma.view(-1, 1, 1))
        with autocast(dev):
            _, logits = block(z, sigma, ctx.to(dev))
        return float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.to(dev).reshape(-1)))

    @torch.no_grad()
    def generate_one_sweep(self, hops, prompt, n_bytes, *, temperature=0.0, generator=None) -> bytes:
        p = prepare_prompt(prompt, n_bytes, self.cfg.seq_len, one_sweep=True)
        plen = len(p)
        # position t predicts byte t+1: predictions for the n new bytes sit at plen-1 .. plen+n-2
        ctx = torch.tensor(list(p) + [32] * (n_bytes - 1), dtype=torch.long).unsqueeze(0)
        estimate: list[torch.Tensor] = []

        def update(b: int, logits: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
            est = sample_bytes(logits[:, plen - 1:], temperature, generator)
            estimate[:] = [est]
            context = context.clone()
            context[:, plen:] = est[:, :-1]
            return context

        z = self._start_state(1, ctx.shape[1], generator, ctx.device)
        traverse(hops, self.sigmas, z, ctx, logits_from="all", update_context=update)
        return bytes(estimate[0][0].tolist())

    @torch.no_grad()
    def generate_autoregressive(self, hops, prompt, n_bytes, *, temperature=0.0, generator=None) -> bytes:
        seq = list(prepare_prompt(prompt, n_bytes, self.cfg.seq_len, one_sweep=False))
        out: list[int] = []
        for _ in range(n_bytes):
            window = seq[-self.cfg.seq_len:]
            ctx = torch.tensor(window, dtype=torch.long).unsqueeze(0)
            z = self._start_state(1, ctx.shape[1], generator, ctx.device)
            _, logits = traverse(hops, self.sigmas, z, ctx)
            nxt = int(sample_bytes(logits[:, -1], temperature, generator)[0])
            seq.append(nxt)
            out.append(nxt)
        return bytes(out)
