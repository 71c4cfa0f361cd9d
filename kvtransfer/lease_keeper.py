"""Prefill side of the KV lease: keeps a decode node's reservations alive while the prompts that
will fill them wait in this node's queue or are being computed.

Why a lease, and not reserving the decode blocks only once the prefill is scheduled: the decode
node has to name its blocks (same-host pages are written straight into them) and the prompt's
blocks it has cached (those are not pushed) before the prefill node computes anything, and the
prefill scheduler runs on the engine thread with no network code: asking a decode node for blocks
at schedule time would stall every step on a round trip and tie prefill batching to decode
capacity. So the decode node reserves at once and holds the blocks under a lease (as vLLM's
disaggregated transfer holds blocks under a heartbeat-renewed lease), and this node renews it
while it has the prompt. A long but healthy queue never fails a request; renewals that stop (this
node died) or a release on the decode side (the client went away, the transfer failed) end it
within one lease period. The price is decode blocks idle while the prompt waits here: the
gateway bounds queued prompt tokens, and a full decode pool makes new requests wait for blocks
(decode_service/reservation_queue.py).

Lifecycle of one request's lease (all on the event loop):
  1. `hold(request_id, address)` when its Prefill call arrives (the decode node's lease has run
     since it answered `reserved`);
  2. one task per decode address renews every lease held at that address in one RenewLeases
     call: at once when the task starts, then every third of the lease period the decode node
     states; the task ends when the address has no lease left;
  3. the lease is lost when the decode node names its request released, or when no renewal to
     its address got through for a whole lease period (the node is gone): `lease.lost` then
     completes with the reason, and the prefill servicer drops the prompt and frees its blocks;
  4. `release(lease)` once the push is committed or failed, or the request ended here.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from kvtransfer.base import DEFAULT_LEASE_S, KvSender, TransferError

logger = logging.getLogger(__name__)


@dataclass(eq=False)  # compared by identity: two calls may carry the same request id
class Lease:
    """One prompt's hold on a decode node's reservation; `lost` completes with the reason once
    the decode node no longer holds the blocks."""

    request_id: str
    address: str
    lost: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class LeaseKeeper:
    """Owns one renewal task per decode address that has leases; mutates only its own maps."""

    def __init__(self, sender: KvSender, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.sender = sender
        self.lease_s = lease_s  # the period assumed until a decode node states its own
        self._address_to_leases: dict[str, set[Lease]] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    @property
    def num_leases(self) -> int:
        return sum(len(leases) for leases in self._address_to_leases.values())

    def hold(self, request_id: str, address: str) -> Lease:
        lease = Lease(request_id, address)
        self._address_to_leases.setdefault(address, set()).add(lease)
        if address not in self._tasks:
            self._tasks[address] = asyncio.create_task(self._renew(address), name=f"renew-leases-{address}")
        return lease

    def release(self, lease: Lease) -> None:
        leases = self._address_to_leases.get(lease.address, set())
        leases.discard(lease)
        if not leases:
            self._address_to_leases.pop(lease.address, None)

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _renew(self, address: str) -> None:
        loop = asyncio.get_running_loop()
        lease_s, last_renewed = self.lease_s, loop.time()
        try:
            while leases := self._address_to_leases.get(address):
                request_ids = {lease.request_id for lease in leases}
                try:
                    renewal = await self.sender.renew_leases(address, sorted(request_ids), timeout_s=lease_s / 3)
                except TransferError as error:
                    if loop.time() - last_renewed >= lease_s:  # the decode node has let them go by now
                        self._lose(address, request_ids, f"no renewal reached it for {lease_s:.1f} s ({error})")
                else:
                    lease_s, last_renewed = renewal.lease_s or lease_s, loop.time()
                    self._lose(address, set(renewal.released_request_ids), "it released the blocks")
                await asyncio.sleep(lease_s / 3)
        finally:
            self._tasks.pop(address, None)

    def _lose(self, address: str, request_ids: set[str], reason: str) -> None:
        for lease in [lease for lease in self._address_to_leases.get(address, ()) if lease.request_id in request_ids]:
            self.release(lease)
            if not lease.lost.done():
                logger.info("request %s: lease lost: decode node %s: %s", lease.request_id, address, reason)
                lease.lost.set_result(f"decode node {address}: {reason}")
