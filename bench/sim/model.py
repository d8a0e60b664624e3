"""What the simulator is told: members, churn, timings, policy. Every default is an assumption
(stated in ``ASSUMED``), to be calibrated against a real multi-node run."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

from blocktrain.node.routing.selection import RebalancePolicy

HOUR, DAY = 3600.0, 86400.0

# Two churn settings, both assumed (no measured volunteer traces yet):
#   volunteer: sessions log-normal with median 2 h and sigma 1.2 (mean 4.1 h, 5% of sessions
#              over 14 h, 10% under 25 min); an offline member comes back once a day on average.
#   harsh:     median 20 min, sigma 1.5 (mean 1 h, 10% of sessions under 3 min); back every 8 h.
CHURN_PRESETS: dict[str, dict] = {
    "volunteer": dict(session_dist="lognormal", session_median_h=2.0, session_sigma=1.2, join_rate_per_day=1.0),
    "harsh": dict(session_dist="lognormal", session_median_h=1 / 3, session_sigma=1.5, join_rate_per_day=3.0),
}

ASSUMED = {
    "sessions": "heavy-tailed session lengths (log-normal or Pareto, parameters above); offline gaps exponential",
    "download": "block download time log-normal, median 60 s, sigma 0.8 (p95 ~3.7 min); the 16-node run measured "
                "43.7 s from process start to serving on 2026-12-01 (97.5 s on 2026-11-30; tiny blocks, loaded 2-core "
                "machine), and a 58.7 MB block's late-join download over 20 Mbit/s 24.9 s (49.8 s until 2026-12-06, when "
                "the late join first tried the averager; BENCHMARKS.md)",
    "graceful": "half of the leaves withdraw their announcement at once; the others' records live out their TTL",
    "dht": "announcements are visible to everyone as soon as they are stored (no propagation delay), unless "
           "record_lag_s > 0: then a join's or a move's `joining` record reaches the others that many seconds after "
           "its decision, and members check for a move at their own phase of the period (uniform), each seeing only "
           "the moves decided at least record_lag_s before its own check; `online` records and withdrawals stay instant",
    "averaging": "a round per block every 60 s (the node's default --average-clock 60 gives each block one such "
                 "instant a minute; its step-triggered rounds come on top): every ready holder of the block takes "
                 "part, split into "
                 "ceil(n/4) groups of near-equal size; a group fails if a member leaves (or finishes a move) "
                 "within the 8 s round window (3 s matchmaking + 5 s all-reduce); a lone holder cannot average",
    "generation": "instantaneous; per block, announced online holders tried in random order, 5 tries "
                  "(router: max_attempts=4 retries), no ban memory between generations; a try at a ready "
                  "holder fails with probability hop_failure (default 0)",
    "moves": "make before break: a mover keeps serving its old block until the new one is downloaded; a move "
             "takes a join's time unless move_median_s is given (the node measured 3.6 s and 0.78 s for a tiny block's "
             "move, tests/test_rebalance_network.py, against 43.7-97.5 s restart to serving: a move starts no process "
             "and joins no DHT; a real block adds its size over the uplink to both: a 58.7 MB block's move download "
             "took 25 s over 20 Mbit/s, BENCHMARKS.md 'Move time for a real block')",
    "sources": "a join or a move downloads min(state_sources, the block's announced ready holders) states at once "
               "and judges them (the node's --state-sources, default 2); they add transfer_s x ceil(states / "
               "parallel_states) to its time (default transfer 0: the calibrated download is a tiny block's; a 58.7 MB "
               "block over 20 Mbit/s links took 24.9 s for one state, 49.6 s for two through a 20 Mbit/s downlink, "
               "25.2 s for two through an unlimited one)",
}


@dataclass
class SimSettings:
    members: int = 1000
    days: float = 3.0                   # measured time, after the warm-up
    warmup_h: float = 12.0              # not measured: the population settles from its start
    blocks: int = 32
    seed: int = 0
    # churn: an offline member comes back after an exponential gap with this rate; sessions:
    join_rate_per_day: float = 1.0
    session_dist: str = "lognormal"     # lognormal | pareto | none (never leave)
    session_median_h: float = 2.0
    session_sigma: float = 1.2          # log-normal shape
    pareto_alpha: float = 1.5           # Pareto shape (> 1: finite mean)
    # the node and the network (assumed, see ASSUMED)
    download_median_s: float = 60.0
    download_sigma: float = 0.8
    move_median_s: float | None = None  # a rebalancing move's download (no process start); None: as a join's
    # judged downloads (node/state_fetch.py fetch_best): a join or a move fetches min(state_sources, announced
    # ready holders) states at once; transfer_s is one block state over a holder's uplink, and the member's
    # downlink carries parallel_states of them at that speed (1: its link is as slow as theirs)
    state_sources: int = 1
    transfer_s: float = 0.0
    parallel_states: int = 1
    graceful_fraction: float = 0.5
    record_lag_s: float = 0.0           # a `joining` record reaches the others this long after the decision (0: at once)
    ttl_s: float = 30.0                 # announcement TTL; refreshed (and rebalancing checked) every TTL/3
    round_period_s: float = 60.0
    round_window_s: float = 8.0
    group_size: int = 4                 # hivemind target_group_size
    attempts: int = 5                   # router: first try + max_attempts=4 retries
    hop_failure: float = 0.0            # P(one try at a ready, online holder fails anyway), independent
    throughput_sigma: float = 0.5       # per-member throughput, log-normal (only breaks ties in selection)
    # policy
    rebalance: bool = False
    policy: RebalancePolicy = field(default_factory=RebalancePolicy)
    # scenario hooks (tests)
    initial_layout: tuple[int, ...] | None = None   # members 0..len-1 start online, ready, on these blocks
    kill: tuple[float, int] | None = None            # (hour after the start, block): its ready holders crash
    check_view: bool = False            # at every join, also rebuild the holder map and call choose_block
    bin_s: float = 3600.0               # timeline resolution (plot)

    @property
    def period_s(self) -> float:
        return self.ttl_s / 3

    def validate(self) -> None:
        if self.members < 1 or self.blocks < 1:
            raise ValueError(f"members and blocks must be >= 1, got {self.members}, {self.blocks}")
        if self.move_median_s is not None and not self.move_median_s > 0:
            raise ValueError(f"move_median_s must be > 0, got {self.move_median_s}")
        if self.state_sources < 1 or self.parallel_states < 1 or not self.transfer_s >= 0:
            raise ValueError(f"state_sources and parallel_states must be >= 1 and transfer_s >= 0, got "
                             f"{self.state_sources}, {self.parallel_states}, {self.transfer_s}")
        if not self.days > 0 or self.warmup_h < 0:
            raise ValueError(f"days must be > 0 and warmup_h >= 0, got {self.days}, {self.warmup_h}")
        if self.session_dist not in ("lognormal", "pareto", "none"):
            raise ValueError(f"session_dist must be lognormal, pareto or none, got {self.session_dist!r}")
        if self.session_dist == "pareto" and not self.pareto_alpha > 1:
            raise ValueError(f"pareto_alpha must be > 1 (finite mean), got {self.pareto_alpha}")
        if not (self.join_rate_per_day > 0 and self.session_median_h > 0 and self.session_sigma >= 0):
            raise ValueError("join rate and session median must be > 0, session sigma >= 0")
        if not 0 <= self.graceful_fraction <= 1:
            raise ValueError(f"graceful_fraction must be in [0, 1], got {self.graceful_fraction}")
        if not 0 <= self.hop_failure < 1 or not self.round_window_s > 0:
            raise ValueError(f"hop_failure must be in [0, 1) and round_window_s > 0, got {self.hop_failure}, "
                             f"{self.round_window_s}")
        if not 0 <= self.record_lag_s < self.period_s:
            raise ValueError(f"record_lag_s must be in [0, ttl_s / 3 = {self.period_s:g}), got {self.record_lag_s}")
        if self.group_size < 2 or self.attempts < 1 or not self.ttl_s > 0:
            raise ValueError("group_size must be >= 2, attempts >= 1, ttl_s > 0")
        if self.initial_layout is not None and (len(self.initial_layout) > self.members or
                                                any(not 0 <= b < self.blocks for b in self.initial_layout)):
            raise ValueError("initial_layout: at most one block per member, each in range")

    def with_churn(self, name: str) -> "SimSettings":
        return replace(self, **CHURN_PRESETS[name])

    # -- distributions (one member's draws come from its own generator) -------------------------
    def mean_session_s(self) -> float:
        m = self.session_median_h * HOUR
        if self.session_dist == "none":
            return math.inf
        if self.session_dist == "lognormal":
            return m * math.exp(self.session_sigma ** 2 / 2)
        a = self.pareto_alpha
        return m / 2 ** (1 / a) * a / (a - 1)

    def online_fraction(self) -> float:
        """Long-run fraction of time a member is online (each one alternates sessions and gaps)."""
        s = self.mean_session_s()
        return 1.0 if math.isinf(s) else s / (s + DAY / self.join_rate_per_day)

    def draw_session_s(self, r: random.Random) -> float:
        m = self.session_median_h * HOUR
        if self.session_dist == "none":
            r.random()                      # keep every member's stream in step across settings
            return math.inf
        if self.session_dist == "lognormal":
            return r.lognormvariate(math.log(m), self.session_sigma)
        a = self.pareto_alpha
        return m / 2 ** (1 / a) * r.paretovariate(a)

    def draw_gap_s(self, r: random.Random) -> float:
        return r.expovariate(self.join_rate_per_day / DAY)

    def transfer_time_s(self, ready_holders: int) -> float:
        """What fetching the block's states adds to a join or a move: the states compared, downloaded at once,
        ``parallel_states`` of them at a holder's uplink speed."""
        return self.transfer_s * math.ceil(min(self.state_sources, ready_holders) / self.parallel_states)

    def draw_download_s(self, r: random.Random) -> float:
        return r.lognormvariate(math.log(self.download_median_s), self.download_sigma)

    def draw_move_s(self, r: random.Random) -> float:
        """A move: the node already runs (no process start, no DHT join): fetch the state, start an averager."""
        median = self.download_median_s if self.move_median_s is None else self.move_median_s
        return r.lognormvariate(math.log(median), self.download_sigma)

    def describe_churn(self) -> str:
        if self.session_dist == "none":
            return "no churn (members never leave)"
        shape = (f"sigma {self.session_sigma:g}" if self.session_dist == "lognormal"
                 else f"alpha {self.pareto_alpha:g}")
        return (f"{self.session_dist} sessions, median {self.session_median_h * 60:.0f} min, {shape} "
                f"(mean {self.mean_session_s() / HOUR:.1f} h); back {self.join_rate_per_day:g}x/day when offline; "
                f"expected online {self.online_fraction() * self.members:.0f} of {self.members}")
