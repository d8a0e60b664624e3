"""The routing wing: which block a node holds (``selection``), how holders are ranked on this
node's own measurements (``ranking``), one ban list (``bans``), the two hop adapters between the
model and the wire (``hops``), and client routing with failover (``router``)."""
