"""blocktrain.p2p: the wire layer on hivemind (no training logic; imports nothing from node/, cli/, blocks/).

Modules, one concern each:

* ``addresses``  validate user multiaddrs (``parse_multiaddr``, ``parse_initial_peers``, ``host_maddr``)
* ``identity``   persistent, locked node identity; one RSA key = PeerID + DHT record signer (``NodeIdentity``)
* ``records``    pydantic models ``RunManifest``, ``BlockAnnouncement``
* ``dht_schema`` DHT keys/subkeys and the strict schemas every node enforces (``make_validators``)
* ``discovery``  ``Discovery``: start/join the DHT, manifest, announce/withdraw, holders
* ``reachability`` the dial-back check (can peers dial us?) and the client-mode/relay options that follow
* ``hops``       hop request/response types, ``HopLimits`` and request validation
* ``tensors``    strict tensor codec and streaming reassembly
* ``rpc_server`` ``BlockRPCServer`` / ``BlockService`` (hivemind ServicerBase, one namespace per block)
* ``rpc_client`` ``HopClient``: forward hops and block-state downloads with timeouts and typed errors
* ``traffic``    ``TrafficCounter``: bytes on the wire
* ``aioloop``    ``LoopThread``: an event loop in a thread for thread-based callers
* ``errors``     every error type raised here
* ``averager``   ``BlockAveragerHandle``: hivemind's DecentralizedAverager for one block, behind a small handle
* ``process``    hivemind's child processes as a node's children: stop signals, dying with the node

* ``process`` / ``inprocess`` hivemind's DHT and averager loops: threads of the node (default) or its children
* ``lean_imports`` imports hivemind makes that a node does not use (scipy, hivemind.moe / .optim), deferred to first use
* ``unary_guard`` a fix for hivemind's unary calls (a call cancelled as its answer arrived silenced the P2P instance)

Submodules are not imported here, so ``import blocktrain.p2p`` stays cheap; only the sharing strategy
hivemind will give torch is chosen here, before any submodule imports hivemind (p2p/inprocess.py),
and scipy.optimize, which hivemind imports but a node never calls, and hivemind's package ``__init__``
(its mixture-of-experts and optimizer packages) are made lazy (p2p/lean_imports.py), and hivemind's
unary-call client is guarded the moment it is imported (p2p/unary_guard.py).
"""
from blocktrain.p2p.inprocess import default_sharing_strategy as _default_sharing_strategy
from blocktrain.p2p.lean_imports import defer_hivemind_init as _defer_hivemind_init
from blocktrain.p2p.lean_imports import defer_scipy_optimize as _defer_scipy_optimize
from blocktrain.p2p.unary_guard import install_on_import as _guard_unary_calls

_default_sharing_strategy()
_defer_scipy_optimize()
_defer_hivemind_init()
_guard_unary_calls()
