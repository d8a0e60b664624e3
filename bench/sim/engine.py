"""The discrete-event simulator: members join, download, announce, average, serve, move and leave.

One event heap (``heapq``). What a member *sees* is the announcement view: per block, the live
records (joining or online) of every peer, including records of members that crashed, which stay
until their TTL runs out (a graceful leave withdraws them at once). Joining uses the real
``least_held`` behind ``choose_block``; rebalancing calls the real ``rebalance_target`` on the
same live and ready counts ``block_load`` and ``ready_load`` would compute from the view
(``check_view`` rebuilds the view at every join and asserts that). What *happens* is the truth: a block is covered while at least one online
member has finished downloading it (a ready holder). Coverage is exact: :meth:`advance` integrates the
time with an empty block between consecutive events (only events change it); holders per block and
generation success are sampled at every TICK. :meth:`record_episode` logs what led to each empty
episode.

Over 400 lines on purpose: one event loop and the bookkeeping every event shares (the view, the truth,
the measurements and the empty-episode log) stay in one class.

Deterministic given the seed: each member draws its sessions from its own generator, in the same
order whatever the policy, so both policies see the same arrivals and departures; moves, groups
and policy draws come from separate generators.
"""
from __future__ import annotations

import heapq
import math
import random
from math import comb

import numpy as np

from blocktrain.node.routing.selection import (
    Holder, block_load, choose_block, least_held, may_switch, ready_load, rebalance_target, switch_counts,
)

from .model import DAY, HOUR, SimSettings

JOIN, LEAVE, READY, EXPIRE, TICK, ROUND, KILL, RECORD = range(8)


class Simulation:
    def __init__(self, s: SimSettings):
        s.validate()
        self.s = s
        n, nb = s.members, s.blocks
        self.t0 = s.warmup_h * HOUR                       # measuring starts here
        self.end = self.t0 + s.days * DAY
        self.heap: list = []
        self.seq = 0
        self.now = 0.0
        self.mrng = [random.Random(f"{s.seed}:member:{m}") for m in range(n)]
        self.move_rng = random.Random(f"{s.seed}:moves")
        self.round_rng = random.Random(f"{s.seed}:rounds")
        # members
        self.online = [False] * n
        self.block = [-1] * n           # block served (download finished), -1 none
        self.pending = [-1] * n         # block being downloaded (join or move), -1 none
        self.moving = [False] * n       # ... by a move (the member serves another block meanwhile)
        self.session = [0] * n
        self.join_t = [0.0] * n
        self.leave_t = [math.inf] * n
        self.switch_t = [math.inf] * n  # when a move in flight leaves the old block
        self.held_since = [0.0] * n
        self.graceful = [False] * n
        self.gap = [0.0] * n
        self.tput = [max(1, round(100 * r.lognormvariate(0.0, s.throughput_sigma))) for r in self.mrng]
        # the announcement view
        self.recs: list[dict[int, str]] = [{} for _ in range(n)]   # block -> "joining" | "online"
        self.rec_t: dict[tuple[int, int], float] = {}              # (member, block) -> stored at
        self.rec_ver: dict[tuple[int, int], int] = {}
        self.cnt = [0] * nb             # live holders per block as block_load counts them
        self.tp = [0] * nb              # their total throughput (integers: sums are exact)
        self.rdy = [0] * nb             # of those, online (ready) as ready_load counts them
        self.ann_online: list[set[int]] = [set() for _ in range(nb)]
        # the truth
        self.ready = [0] * nb
        self.members_in: list[set[int]] = [set() for _ in range(nb)]
        self.n_zero = nb
        # measurements
        self.last_t = 0.0
        self.uncovered_s = 0.0
        self.block_uncovered_s = 0.0
        self.episodes = 0
        self.empty_since = [0.0] * nb
        self.lone_since = [0.0] * nb    # when the block last went down to one ready holder
        self.inflight = [0] * nb        # members downloading the block now (joiners and movers): the truth
        self.inflight_moves = [0] * nb  # of those, movers
        self.cause = ""                 # why the member being unserved stops serving (episode records)
        self.episode_log: list[dict] = []   # every empty episode in measured time: what led to it
        self.open_episode: dict[int, dict] = {}
        self.episode_s: list[float] = []
        nbins = int(math.ceil(s.days * DAY / s.bin_s))
        self.bin_uncovered = np.zeros(nbins)
        self.samples: list[list[int]] = []
        self.sample_t: list[float] = []
        self.online_n: list[int] = []
        self.gen_ok: list[float] = []
        self.gen_uncovered = 0
        self.round_ready = 0
        self.round_ok = 0
        self.rounds_failed_leave = 0
        self.moves = 0
        self.urgent_moves = 0           # moves to a block that had fewer than urgent_below ready holders
        self.reserve_moves = 0          # moves to a block in the reserve tier (urgent_below <= ready < reserve_below)
        self.joins = 0
        self.abandoned = 0              # moves abandoned at the switch (selection.may_switch: the old block would be left short)

    # -- plumbing --------------------------------------------------------------------------------
    def push(self, t: float, kind: int, m: int = -1, arg=None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, m, arg))

    def advance(self, t: float) -> None:
        """Integrate coverage from the last event to t (measured time only)."""
        a, b = max(self.last_t, self.t0), min(t, self.end)
        if b > a and self.n_zero:
            self.uncovered_s += b - a
            self.block_uncovered_s += (b - a) * self.n_zero
            x = a
            while x < b:                                   # spread over the timeline bins
                i = int((x - self.t0) // self.s.bin_s)
                edge = min(b, self.t0 + (i + 1) * self.s.bin_s)
                self.bin_uncovered[min(i, len(self.bin_uncovered) - 1)] += edge - x
                x = edge
        self.last_t = max(self.last_t, t)

    @staticmethod
    def counted(recs: dict[int, str]):
        """The blocks a peer's live records count in (``block_load``'s rule: a mover counts where it joins)."""
        if len(recs) > 1 and "joining" in recs.values():
            return [b for b, st in recs.items() if st == "joining"]
        return list(recs)

    def set_rec(self, m: int, b: int, state: str | None) -> None:
        recs, w = self.recs[m], self.tput[m]
        for c in self.counted(recs):
            self.cnt[c] -= 1
            self.tp[c] -= w
            self.rdy[c] -= recs[c] == "online"
        if recs.get(b) == "online":
            self.ann_online[b].discard(m)
        if state is None:
            recs.pop(b, None)
            self.rec_t.pop((m, b), None)
        else:
            if b not in recs:
                self.rec_t[(m, b)] = self.now
            recs[b] = state
            if state == "online":
                self.ann_online[b].add(m)
        for c in self.counted(recs):
            self.cnt[c] += 1
            self.tp[c] += w
            self.rdy[c] += recs[c] == "online"
        self.rec_ver[(m, b)] = self.rec_ver.get((m, b), 0) + 1

    def view(self) -> dict[int, list[Holder]]:
        """The holder map a node would read from the DHT right now."""
        h: dict[int, list[Holder]] = {}
        for m, recs in enumerate(self.recs):
            for b, st in recs.items():
                h.setdefault(b, []).append(Holder(b, f"m{m}", st, float(self.tput[m])))
        return h

    def switch_counts(self, m: int, old: int, b: int) -> tuple[int, int]:
        """``selection.switch_counts`` at member m's switch from ``old`` to ``b``, on the announced records of
        the members that hold a record of either block (all it reads)."""
        view: dict[int, list[Holder]] = {}
        for p, recs in enumerate(self.recs):
            if old not in recs and b not in recs:
                continue
            for c, st in recs.items():
                view.setdefault(c, []).append(Holder(c, f"m{p}", st))
        return switch_counts(view, self.s.blocks, old, b, f"m{m}")

    def serve(self, m: int, b: int, how: str = "join") -> None:
        self.block[m] = b
        self.members_in[b].add(m)
        self.ready[b] += 1
        if self.ready[b] == 1:
            self.n_zero -= 1
            self.lone_since[b] = self.now
            if self.now > self.t0 and self.empty_since[b] >= self.t0:
                self.episode_s.append(self.now - self.empty_since[b])
            ep = self.open_episode.pop(b, None)
            if ep is not None:
                ep["length_s"], ep["ended_by"] = self.now - self.empty_since[b], how

    def unserve(self, m: int) -> None:
        b = self.block[m]
        self.block[m] = -1
        self.members_in[b].discard(m)
        self.ready[b] -= 1
        if self.ready[b] == 1:
            self.lone_since[b] = self.now
        if self.ready[b] == 0:
            self.n_zero += 1
            self.empty_since[b] = self.now
            if self.now >= self.t0:
                self.episodes += 1
                self.record_episode(m, b)

    def record_episode(self, m: int, b: int) -> None:
        """What led to block b's empty episode, as it starts: how its last ready holder went, how long it
        had been the only one, and who was on the way (the truth, and the announced view)."""
        ep = {"t_h": round((self.now - self.t0) / HOUR, 3), "block": b, "cause": self.cause,
              "lone_s": round(self.now - self.lone_since[b], 1), "held_s": round(self.now - self.held_since[m], 1),
              "inflight": self.inflight[b], "inflight_moves": self.inflight_moves[b],
              "announced_live": self.cnt[b], "announced_ready": self.rdy[b],
              "ready_elsewhere_min": min((r for c, r in enumerate(self.ready) if c != b), default=0),
              "length_s": None, "ended_by": None}
        self.episode_log.append(ep)
        self.open_episode[b] = ep

    def set_pending(self, m: int, b: int, move: bool = False) -> None:
        """Member m starts downloading block b (b >= 0), or stops (b = -1: landed, or left)."""
        old = self.pending[m]
        if old >= 0:
            self.inflight[old] -= 1
            self.inflight_moves[old] -= self.moving[m]
        self.pending[m], self.moving[m] = b, move and b >= 0
        if b >= 0:
            self.inflight[b] += 1
            self.inflight_moves[b] += self.moving[m]

    # -- events ----------------------------------------------------------------------------------
    def join(self, m: int, layout_block: int | None = None) -> None:
        s, r = self.s, self.mrng[m]
        self.online[m] = True
        self.session[m] += 1
        self.join_t[m] = self.now
        session = s.draw_session_s(r)
        download = s.draw_download_s(r)
        self.graceful[m] = r.random() < s.graceful_fraction
        self.gap[m] = s.draw_gap_s(r)
        self.leave_t[m] = self.now + session
        if session < math.inf:
            self.push(self.leave_t[m], LEAVE, m, self.session[m])
        if layout_block is not None:                      # a scenario's starting holder: ready now
            self.set_rec(m, layout_block, "online")
            self.serve(m, layout_block)
            self.held_since[m] = self.now
            return
        self.joins += self.now >= self.t0
        b = least_held(self.cnt, self.tp)
        if s.check_view:
            view = self.view()
            assert block_load(view, s.blocks) == (self.cnt, [float(x) for x in self.tp]), "view out of step"
            assert ready_load(view, s.blocks) == self.rdy, "ready view out of step"
            assert choose_block(view, s.blocks) == b
        download += s.transfer_time_s(self.rdy[b])   # judged download: the states compared, fetched at once
        self.set_pending(m, b)
        self.announce_joining(m, b)
        self.push(self.now + download, READY, m, (self.session[m], b))

    def announce_joining(self, m: int, b: int, lag: float | None = None) -> None:
        """Member m (pending b) stores its ``joining`` record of b: the others see it ``record_lag_s`` later."""
        lag = self.s.record_lag_s if lag is None else lag
        if lag > 0:
            self.push(self.now + lag, RECORD, m, (self.session[m], b))
        else:
            self.set_rec(m, b, "joining")

    def record_event(self, m: int, arg) -> None:
        sess, b = arg
        if sess == self.session[m] and self.online[m] and self.pending[m] == b and b not in self.recs[m]:
            self.set_rec(m, b, "joining")

    def ready_event(self, m: int, arg) -> None:
        sess, b = arg
        if sess != self.session[m] or not self.online[m] or self.pending[m] != b:
            return
        self.set_pending(m, -1)
        old = self.block[m]
        if old >= 0 and not may_switch(*self.switch_counts(m, old, b), self.s.policy):   # the node abandons
            self.set_rec(m, b, None)                       # the move (node/rebalance.py), stays put
            self.switch_t[m] = math.inf
            self.held_since[m] = self.now
            self.abandoned += self.now >= self.t0
            return
        if old >= 0:                                      # a move lands: withdraw the old block
            self.cause = "moved away"
            self.unserve(m)
            self.set_rec(m, old, None)
            self.switch_t[m] = math.inf
        self.set_rec(m, b, "online")
        self.serve(m, b, "move" if old >= 0 else "join")
        self.held_since[m] = self.now

    def leave(self, m: int, sess, graceful: bool | None = None) -> None:
        if sess is not None and (sess != self.session[m] or not self.online[m]):
            return
        graceful = self.graceful[m] if graceful is None else graceful
        mine = [b for b in (self.block[m], self.pending[m]) if b >= 0]
        self.online[m] = False
        self.leave_t[m] = self.now
        if self.block[m] >= 0:
            self.cause = "left (withdrew)" if graceful else "left (crashed)"
            self.unserve(m)
        self.set_pending(m, -1)
        self.switch_t[m] = math.inf
        period = self.s.period_s
        last = self.join_t[m] + math.floor((self.now - self.join_t[m]) / period) * period
        for b in mine:
            if graceful:
                self.set_rec(m, b, None)
            elif b in self.recs[m]:                        # the record lives until its TTL runs out
                stored = max(last, self.rec_t.get((m, b), last))
                self.push(stored + self.s.ttl_s, EXPIRE, m, (b, self.rec_ver[(m, b)]))
        self.push(self.now + self.gap[m], JOIN, m)

    def expire(self, m: int, arg) -> None:
        b, ver = arg
        if self.rec_ver.get((m, b)) == ver:
            self.set_rec(m, b, None)

    def tick(self) -> None:
        s = self.s
        if self.now >= self.t0:
            self.sample()
        if s.rebalance:
            self.rebalance()
        self.push(self.now + s.period_s, TICK)

    def sample(self) -> None:
        self.samples.append(list(self.ready))
        self.sample_t.append(self.now)
        self.online_n.append(sum(self.online))
        if self.n_zero:
            self.gen_ok.append(0.0)
            self.gen_uncovered += 1
            return
        p = 1.0                       # P(a generation now succeeds): per block, P(some try succeeds)
        f = self.s.hop_failure
        for b in range(self.s.blocks):
            n, good = len(self.ann_online[b]), self.ready[b]
            k = min(self.s.attempts, n)
            dead = n - good
            if f == 0.0:              # every try at a ready holder succeeds: fail only if all k hit dead records
                if dead >= k:
                    p *= 1.0 - comb(dead, k) / comb(n, k)
                continue
            # j of the k tries hit ready holders (hypergeometric), each of those fails with probability f
            fail = sum(comb(good, j) * comb(dead, k - j) / comb(n, k) * f ** j
                       for j in range(max(0, k - dead), min(k, good) + 1))
            p *= 1.0 - fail
        self.gen_ok.append(p)

    def rebalance(self) -> None:
        """Every ready member not mid-move checks the rule once per period, in a random order, each
        seeing the moves before it. Members that cannot pass the rule are skipped up front (speed
        only: ``rebalance_target`` decides)."""
        s, pol, cnt, rdy = self.s, self.s.policy, self.cnt, self.rdy

        def keeps(b: int) -> bool:
            return cnt[b] - 1 >= pol.min_keep and rdy[b] - 1 >= pol.min_keep

        lo = min(cnt)
        # rule 5 (urgent or reserve) may apply: no dwell, any block that keeps 2
        urgent = any(pol.wanted(rdy[b], cnt[b] - rdy[b]) for b in range(s.blocks))
        if not urgent and max(cnt) - lo < pol.min_surplus:
            return
        donors = [b for b in range(s.blocks) if keeps(b) and (urgent or cnt[b] - lo >= pol.min_surplus)]
        cands = sorted(m for b in donors for m in self.members_in[b]
                       if self.pending[m] < 0 and (urgent or self.now - self.held_since[m] >= pol.min_dwell_s))
        lag = s.record_lag_s
        if lag > 0:   # each member checks at its own phase of the period and sees moves decided lag before it
            phase = {m: self.move_rng.random() * s.period_s for m in cands}
            cands.sort(key=phase.__getitem__)
        else:         # every move is seen by the next check: only the order matters, and it is random
            self.move_rng.shuffle(cands)
        unseen: list[tuple[float, int, int]] = []   # (phase at which others see it, member, block) of lagged moves
        neediest = None               # fewest ready holders of a block that wants movers (rule 5), while unchanged
        for m in cands:
            while unseen and unseen[0][0] <= phase[m]:
                _, j, tj = unseen.pop(0)
                if self.pending[j] == tj:
                    self.set_rec(j, tj, "joining")
                neediest = None
            if self.pending[m] >= 0:
                continue
            draw = self.move_rng.random()
            b = self.block[m]
            # skip, without changing any draw, a member rebalance_target would surely keep (speed only):
            # rule 5 moves only from a block with min_surplus more ready holders than the neediest
            # wanting block; rules 1-4 only after the dwell from a block min_surplus over the least held
            if neediest is None:
                neediest = min((rdy[c] for c in range(s.blocks) if pol.wanted(rdy[c], cnt[c] - rdy[c])), default=-1)
            rescue = neediest >= 0 and rdy[b] - neediest >= pol.min_surplus
            ordinary = self.now - self.held_since[m] >= pol.min_dwell_s and cnt[b] - min(cnt) >= pol.min_surplus
            if not (keeps(b) and (rescue or ordinary)):
                continue
            t = rebalance_target(cnt, self.tp, b, held_for_s=self.now - self.held_since[m],
                                 draw=draw, policy=pol, ready=rdy)
            if t is None:
                continue
            neediest = None
            download = s.draw_move_s(self.move_rng) + s.transfer_time_s(rdy[t])
            self.set_pending(m, t, move=True)
            self.switch_t[m] = self.now + download
            if lag > 0:
                unseen.append((phase[m] + lag, m, t))
            else:
                self.set_rec(m, t, "joining")
            self.push(self.now + download, READY, m, (self.session[m], t))
            self.moves += self.now >= self.t0
            self.urgent_moves += self.now >= self.t0 and rdy[t] < pol.urgent_below
            self.reserve_moves += self.now >= self.t0 and pol.urgent_below <= rdy[t] < pol.reserve_below
        for _, j, tj in unseen:       # decided late in the period: the others see them lag from now
            self.announce_joining(j, tj, lag)

    def round(self) -> None:
        s = self.s
        if self.now >= self.t0:
            end = self.now + s.round_window_s
            for b in range(s.blocks):
                group = sorted(self.members_in[b])
                n = len(group)
                if n == 0:
                    continue
                self.round_ready += n
                self.round_rng.shuffle(group)
                g = -(-n // s.group_size)
                i = 0
                for j in range(g):
                    size = n // g + (j < n % g)
                    members = group[i:i + size]
                    i += size
                    if size < 2:
                        continue
                    if any(self.leave_t[m] <= end or self.switch_t[m] <= end for m in members):
                        self.rounds_failed_leave += 1
                        continue
                    self.round_ok += size
        self.push(self.now + s.round_period_s, ROUND)

    def kill(self, b: int) -> None:
        for m in sorted(self.members_in[b]):
            self.leave(m, None, graceful=False)

    # -- run ---------------------------------------------------------------------------------------
    def start(self) -> None:
        s = self.s
        init = random.Random(f"{s.seed}:init")
        layout = list(s.initial_layout or [])
        frac = s.online_fraction()
        order = list(range(s.members))
        init.shuffle(order)                                # who arrives first at t=0
        for m in order:
            r = self.mrng[m]
            first = r.random()
            gap = s.draw_gap_s(r)
            if m < len(layout):
                self.join(m, layout[m])
            elif s.initial_layout is None and first < frac:
                self.push(0.0, JOIN, m)
            else:
                self.push(gap, JOIN, m)
        self.push(s.period_s * init.random(), TICK)
        self.push(s.round_period_s * init.random(), ROUND)
        if s.kill is not None:
            self.push(s.kill[0] * HOUR, KILL, -1, s.kill[1])

    def run(self) -> "Simulation":
        self.start()
        heap = self.heap
        while heap and heap[0][0] <= self.end:
            t, _, kind, m, arg = heapq.heappop(heap)
            self.advance(t)
            self.now = t
            if kind == JOIN:
                self.join(m)
            elif kind == READY:
                self.ready_event(m, arg)
            elif kind == LEAVE:
                self.leave(m, arg)
            elif kind == EXPIRE:
                self.expire(m, arg)
            elif kind == TICK:
                self.tick()
            elif kind == ROUND:
                self.round()
            elif kind == RECORD:
                self.record_event(m, arg)
            else:
                self.kill(arg)
        self.advance(self.end)
        self.now = self.end
        return self
