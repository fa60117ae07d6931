"""A phase daemon's job clean-up can end after the daemon closed its sockets (a harness job's
endpoint and sandbox teardown outlast the drain): its last credit announcement must be a no-op,
not an unhandled ``ZMQError: Socket operation on non-socket`` at shutdown."""
from __future__ import annotations

import zmq

from rolloutd.bus.credit import CreditReceiver


def test_credit_update_on_a_closed_socket_is_a_no_op(tmp_path):
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        router.bind(f"ipc://{tmp_path}/s")
        dealer.connect(f"ipc://{tmp_path}/s")
        rx = CreditReceiver(dealer, pool=4)
        rx.update(4)  # a live socket announces
        assert router.poll(5000) and router.recv_multipart()
        dealer.close(linger=0)
        rx.update(3, force=True)  # closed: nothing to tell, nothing raised
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()
