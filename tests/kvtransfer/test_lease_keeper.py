"""The prefill side of the lease: renewals keep a decode node's reservations past their lease
while the prompts wait, and a lease is lost when the decode node releases it or cannot be reached."""

from __future__ import annotations

import asyncio

from kvtransfer.base import KvReceiver, TransferStatus
from kvtransfer.fake import FakeKvSender
from kvtransfer.lease_keeper import LeaseKeeper
from tests.kvtransfer.test_receiver import caches

LEASE_S = 0.3


def decode_node_and_keeper() -> tuple[KvReceiver, FakeKvSender, LeaseKeeper]:
    receiver = KvReceiver(caches(), lease_s=LEASE_S)
    sender = FakeKvSender({"decode": receiver})
    return receiver, sender, LeaseKeeper(sender, lease_s=10.0)  # the decode node's own period wins


def test_renewals_hold_a_reservation_for_many_lease_periods():
    receiver, sender, keeper = decode_node_and_keeper()

    async def main():
        receiver.reserve("queued", [0])
        lease = keeper.hold("queued", "decode")
        waiting = asyncio.create_task(receiver.wait("queued"))
        await asyncio.sleep(4 * LEASE_S)
        assert not waiting.done() and receiver.status("queued") == TransferStatus.PENDING
        assert not lease.lost.done()
        # At once, then every third of the period the decode node states: about 3 per period.
        assert 6 <= sender.num_renewals <= 14
        keeper.release(lease)
        assert keeper.num_leases == 0
        await asyncio.sleep(0.1)
        assert not keeper._tasks  # nothing left to renew there: the task ended
        waiting.cancel()

    asyncio.run(main())


def test_a_lease_the_decode_node_released_is_lost_and_the_others_stay():
    receiver, _, keeper = decode_node_and_keeper()

    async def main():
        receiver.reserve("cancelled", [0])
        receiver.reserve("kept", [1])
        cancelled, kept = keeper.hold("cancelled", "decode"), keeper.hold("kept", "decode")
        await asyncio.sleep(0.01)
        receiver.forget("cancelled")  # the client went away: the decode node dropped it
        reason = await asyncio.wait_for(cancelled.lost, 1.0)
        assert reason == "decode node decode: it released the blocks"
        assert not kept.lost.done() and keeper.num_leases == 1
        await keeper.close()

    asyncio.run(main())


def test_every_lease_at_an_unreachable_decode_node_is_lost_after_a_lease_period():
    _, sender, keeper = decode_node_and_keeper()
    keeper.lease_s = LEASE_S

    async def main():
        sender.unreachable.add("decode")  # the decode node died
        leases = [keeper.hold(rid, "decode") for rid in ("a", "b")]
        start = asyncio.get_running_loop().time()
        reasons = await asyncio.wait_for(asyncio.gather(*(lease.lost for lease in leases)), 2.0)
        assert asyncio.get_running_loop().time() - start >= LEASE_S
        assert all(
            reason.startswith(f"decode node decode: no renewal reached it for {LEASE_S:.1f} s") for reason in reasons
        )
        assert keeper.num_leases == 0

    asyncio.run(main())
