"""A bound on what other peers can make a node's DHT keep in memory.

hivemind's DHT stores whatever any peer sends its ``rpc_store`` under any key (the run's schema allows
extra keys: the averager's and other runs' share the DHT), with no limit on count, size or lifetime,
in its storage and in its cache. An outsider storing 100,000 junk values of 4 KB straight to a node grew
it by 425 MiB in 25 s (``docs/records/s33/dht_flood_probe.py``): any peer could exhaust a volunteer's
memory. :func:`guard_storage` replaces a DHT node's storage and cache by :class:`GuardedStorage`:

- a value larger than ``max_value_bytes`` is refused (BlockTrain's records are a few KB: a signed
  manifest is the largest), and so is one that would live longer than ``max_ttl_s`` (a manifest lives
  at most 30 days);
- a key holds at most ``max_subkeys`` subkeys (a run's holders are one subkey each);
- once the values held reach ``max_bytes``, new keys and subkeys are refused; keys and subkeys
  already held can still be refreshed, so the records of a live network keep their place while the
  junk expires. Nothing is evicted to make room (eviction would let the newest junk push out real
  records).

Refusals are counted (``refused``), and the first of each kind is logged.
"""
from __future__ import annotations

import logging
import time

from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.utils.timed_storage import get_dht_time

logger = logging.getLogger(__name__)

MAX_BYTES = 16 << 20            # values held in the storage (the cache gets a quarter): a 1,000-member run needs ~1 MB
MAX_VALUE_BYTES = 64 << 10
MAX_SUBKEYS = 4096
MAX_TTL_S = 31 * 86400.0
ITEM_OVERHEAD = 160             # bytes per held value beyond its own (key, heap entry, tuple), roughly
RECOUNT_S = 1.0                 # the held bytes are recounted at most this often, added to meanwhile


class GuardedStorage(DHTLocalStorage):
    def __init__(self, *, max_bytes: int = MAX_BYTES, max_value_bytes: int = MAX_VALUE_BYTES,
                 max_subkeys: int = MAX_SUBKEYS, max_ttl_s: float = MAX_TTL_S, name: str = "storage"):
        super().__init__()
        self.max_bytes, self.max_value_bytes, self.max_subkeys, self.max_ttl_s = (
            max_bytes, max_value_bytes, max_subkeys, max_ttl_s)
        self.name = name
        self.refused: dict[str, int] = {"too_big": 0, "too_long": 0, "too_many_subkeys": 0, "full": 0}
        self._held = 0
        self._counted_at = -1e18

    # -- accounting -----------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes of the values held now (recounted at most every RECOUNT_S; expired ones go on recount)."""
        now = time.monotonic()
        if now - self._counted_at >= RECOUNT_S:
            total = 0
            for _key, (value, _exp) in self.items():   # items() drops what has expired
                if isinstance(value, DictionaryDHTValue):
                    total += sum(len(v) + ITEM_OVERHEAD for _s, (v, _e) in value.items())
                else:
                    total += len(value) + ITEM_OVERHEAD
            self._held, self._counted_at = total, now
        return self._held

    def _refuse(self, why: str, detail: str) -> bool:
        if self.refused[why] == 0:
            logger.warning("DHT %s: refusing records from peers (%s); further refusals are only counted", self.name,
                           detail)
        self.refused[why] += 1
        return False

    def _admit(self, value, expiration_time: float, new: bool) -> bool:
        size = len(value) if isinstance(value, (bytes, bytearray)) else 0
        if size > self.max_value_bytes:
            return self._refuse("too_big", f"a value of {size} bytes, over {self.max_value_bytes}")
        if expiration_time > get_dht_time() + self.max_ttl_s:
            return self._refuse("too_long", f"a value to keep {expiration_time - get_dht_time():.0f} s, over "
                                            f"{self.max_ttl_s:.0f}")
        if new and self.held_bytes() + size + ITEM_OVERHEAD > self.max_bytes:
            return self._refuse("full", f"{self.held_bytes()} bytes held, the limit {self.max_bytes}")
        return True

    # -- hivemind's entry points (rpc_store calls store() for values, store_subkey() for subkeys) ------
    def store(self, key, value, expiration_time, subkey=None) -> bool:
        if subkey is not None:
            return self.store_subkey(key, subkey, value, expiration_time)
        if not self._admit(value, expiration_time, new=self.get(key) is None):
            return False
        ok = super().store(key, value, expiration_time)
        if ok:
            self._held += len(value) + ITEM_OVERHEAD
        return ok

    def store_subkey(self, key, subkey, value, expiration_time) -> bool:
        held = self.get(key)
        existing = held.value if held is not None and isinstance(held.value, DictionaryDHTValue) else None
        new = existing is None or existing.get(subkey) is None
        if new and existing is not None and len(existing) >= self.max_subkeys:
            return self._refuse("too_many_subkeys", f"a key with {len(existing)} subkeys, the limit")
        if not self._admit(value, expiration_time, new=new):
            return False
        ok = super().store_subkey(key, subkey, value, expiration_time)
        if ok:
            self._held += len(value) + ITEM_OVERHEAD
        return ok


async def guard_storage(_dht, node) -> None:
    """Run in a DHT's loop (``DHT.run_coroutine``): put its node's storage and cache behind
    :class:`GuardedStorage`, keeping what they hold (nothing yet, right after the DHT started)."""
    protocol = node.protocol
    for attr, budget in (("storage", MAX_BYTES), ("cache", MAX_BYTES // 4)):
        old = getattr(protocol, attr)
        if isinstance(old, GuardedStorage):
            continue
        new = GuardedStorage(max_bytes=budget, name=attr)
        new.maxsize = old.maxsize
        for key, (value, expiration) in old.items():
            DHTLocalStorage.store(new, key, value, expiration)
        setattr(protocol, attr, new)


async def refusals(_dht, node) -> dict[str, int]:
    """What the guarded storage and cache of a DHT node refused, by reason (``DHT.run_coroutine``)."""
    out: dict[str, int] = {}
    for attr in ("storage", "cache"):
        s = getattr(node.protocol, attr)
        for k, v in getattr(s, "refused", {}).items():
            out[k] = out.get(k, 0) + v
    return out
