"""Separate hosts on one machine: a 4-block network of 6 nodes, each in its own network namespace
with its own address, on a bridge whose links are limited to 20 Mbit/s (``tc tbf``). The nodes bind
and announce their namespace addresses, so they talk over those only, never over loopback.

Blocks: h0 seeds block 0, h1 holds block 1, blocks 2 and 3 are held twice (h2+h4, h3+h5). The
network trains, the block-2 pair averages, h0 generates through holders in the other namespaces;
then the namespace of the block-3 holder that served that generation is killed (every process in
it SIGKILLed, the namespace deleted, its link gone) and h0 generates again: block 3 fails over to
its other holder. The tests run in file order; figures go to $BT_RELIABILITY_LOG (RELIABILITY.md).
"""
from __future__ import annotations

import time

import pytest

from test_utils.netns import NetLab, namespaces, skip_without_namespaces
from test_utils.ns_nodes import route_of, start_join, start_seed
from test_utils.reliability import TINY, average_until_accepted, report, wait_for

pytestmark = [pytest.mark.network, pytest.mark.slow]

RUN = "nshosts"
BLOCKS = {"h1": 1, "h2": 2, "h3": 3, "h4": 2, "h5": 3}
RATE_MBIT = 20


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    skip_without_namespaces()
    base = tmp_path_factory.mktemp("nshosts")
    nodes = {}
    with NetLab(rate_mbit=RATE_MBIT) as lab:
        try:
            hosts = {f"h{i}": lab.host(f"h{i}") for i in range(6)}
            nodes["h0"] = start_seed(hosts["h0"], base, RUN, [*TINY, "n_blocks=4"])
            for name, b in BLOCKS.items():
                nodes[name] = start_join(hosts[name], base, nodes["h0"], RUN, block=b)
            for n in nodes.values():
                n.wait_ready(timeout=240)
            yield lab, nodes
        finally:
            for n in nodes.values():
                n.stop(timeout=10)


def _steps(nodes) -> dict[str, int]:
    return {k: n.status()["self"]["step"] for k, n in nodes.items()}


def _every_block_served(seed) -> bool:
    blocks = seed.status()["blocks"]
    return all(any(h["serving"] for h in b["holders"]) for b in blocks)


def test_six_namespaces_train_average_and_generate_through_each_other(net):
    lab, nodes = net
    seed = nodes["h0"]
    for name, n in nodes.items():   # each node lives on its own namespace address, none on loopback
        assert n.info["maddrs"] and all(f"/ip4/{n.host.addr}/" in m for m in n.info["maddrs"]), (name, n.info)
        assert n.status()["self"]["reachability"] == "public", name
    first = wait_for(lambda: (lambda s: s if all(v >= 5 for v in s.values()) else None)(_steps(nodes)), 240,
                     "every node training")
    wait_for(lambda: _every_block_served(seed), 120, "every block announced by a serving holder")
    pair = [nodes["h2"], nodes["h4"]]
    verdicts = average_until_accepted(pair)
    assert all(v.get("accepted") is True for v in verdicts.values()), verdicts
    answer, seconds = seed.generate()
    route = route_of(answer)
    owner = {n.peer_id: name for name, n in nodes.items()}
    assert sorted(route) == [0, 1, 2, 3], answer
    assert route[0] == seed.peer_id                       # its own block, in-process
    assert all(owner[route[b]] != "h0" for b in (1, 2, 3)), route   # the rest from other namespaces
    assert all(BLOCKS[owner[route[b]]] == b for b in (1, 2, 3)), route
    later = _steps(nodes)
    assert all(later[k] > first[k] for k in nodes), (first, later)
    report("netns_hosts_start", route={b: owner[p] for b, p in route.items()}, first_gen_s=round(seconds, 3),
           steps=later, round_accepted={k: v.get("accepted") for k, v in verdicts.items()},
           round_group={k: v.get("relative_change") for k, v in verdicts.items()})


def test_generation_fails_over_when_a_host_namespace_is_killed(net):
    lab, nodes = net
    seed = nodes["h0"]
    owner = {n.peer_id: name for name, n in nodes.items()}
    warm = [seed.generate() for _ in range(3)]
    victim_name = owner[route_of(warm[-1][0])[3]]   # the holder of block 3 that h0's router uses
    other = "h5" if victim_name == "h3" else "h3"
    victim = nodes[victim_name]
    killed = lab.kill_host(victim.host)
    assert killed >= 2, killed   # the node and its p2pd (hivemind's DHT and averager loops are threads of the node)
    assert victim.host.ns not in namespaces()
    victim.proc.wait(timeout=15)
    t0 = time.monotonic()
    answer, seconds = seed.generate(timeout=180)
    route = route_of(answer)
    assert route[3] == nodes[other].peer_id, (answer, other)
    after = [seed.generate()[1] for _ in range(3)]
    survivors = {k: n for k, n in nodes.items() if k != victim_name}
    s1 = _steps(survivors)
    time.sleep(5)
    s2 = _steps(survivors)
    assert all(s2[k] > s1[k] for k in survivors), (s1, s2)   # the rest keep training
    report("netns_hosts", namespaces=6, blocks=4, link_mbit=RATE_MBIT, killed=victim_name,
           processes_killed=killed, failover_to=other, first_after_kill_s=round(seconds, 3),
           failovers=answer.get("failovers"), gen_s_before=[round(x[1], 3) for x in warm],
           gen_s_after=[round(x, 3) for x in after], since_kill_s=round(time.monotonic() - t0, 1))
