"""Redis Cluster hash slots and the slot map (which master serves which slot).

A key's slot is CRC16 (XMODEM, the one ``binascii.crc_hqx`` computes) of its hash tag, the
part between its first ``{`` and the next ``}`` when that is not empty, or of the whole
key, modulo 16384. Every quota key of a tenant carries ``{<tenant>}`` (``keys.tenant_tag``)
and the processors' own keys ``{~p}``: each script touches one slot.
"""

from __future__ import annotations

from binascii import crc_hqx
from collections.abc import Sequence
from typing import Any

SLOTS = 16384

Address = tuple[str, int]


def key_slot(key: str | bytes) -> int:
    """The hash slot of ``key``, as Redis Cluster computes it."""
    data = key.encode() if isinstance(key, str) else key
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return crc_hqx(data, 0) % SLOTS


class SlotMap:
    """Slot → master address, and the replicas named alongside (to ask after a failure).

    Built from a ``CLUSTER SLOTS`` reply: ``[[start, end, [host, port, id, ...], replica...]]``.
    An empty host (or ``?``) means "the node you asked", as Redis documents it.
    """

    __slots__ = ("masters", "owners", "replicas")

    def __init__(
        self, owners: list[Address | None], replicas: frozenset[Address] = frozenset()
    ) -> None:
        self.owners = owners
        self.masters: frozenset[Address] = frozenset(a for a in owners if a is not None)
        self.replicas = replicas

    @classmethod
    def empty(cls) -> SlotMap:
        return cls([None] * SLOTS)

    @classmethod
    def from_cluster_slots(cls, reply: Sequence[Any], asked: Address) -> SlotMap:
        owners: list[Address | None] = [None] * SLOTS
        replicas: set[Address] = set()

        def address(node: Sequence[Any]) -> Address:
            host = node[0]
            if isinstance(host, bytes):
                host = host.decode()
            return (asked[0] if host in ("", "?", None) else host), int(node[1])

        for entry in reply:
            start, end, master, *others = entry
            start, end = int(start), int(end)
            if not 0 <= start <= end < SLOTS:
                raise ValueError(f"CLUSTER SLOTS names slots {start}-{end}")
            owners[start : end + 1] = [address(master)] * (end - start + 1)
            replicas.update(address(node) for node in others)
        return cls(owners, frozenset(replicas))

    @property
    def covered(self) -> int:
        """Slots that have a master."""
        return sum(1 for a in self.owners if a is not None)
