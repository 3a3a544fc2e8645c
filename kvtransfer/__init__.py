"""Layer-wise KV transfer between workers: connector API, NIXL backend, TCP fallback, layout handshake.

    from splitserve.kvtransfer import KVLayout, make_connector
    receiver = make_connector("tcp", "decode-0", layout); receiver.register(pool)
    sender.add_peer(receiver.metadata())                       # handshake (layout hash)
    grant = receiver.reserve(request_id, dst_block_ids, ttl_s)  # travels inside the Prefill call
    sender.write_layer(grant, layer, src_block_ids, dst_block_ids)   # per layer, returns at once
    sender.notify(grant, first_token_bytes); receiver.wait_notification(request_id)

Backends are imported lazily: the NIXL wheel is only needed when "nixl" is asked for.
"""

from splitserve.kvtransfer.backends import make_connector
from splitserve.kvtransfer.connector import AgentMetadata, Connector, Reservation, TransferHandle
from splitserve.kvtransfer.errors import (BlockOutOfRangeError, LayoutMismatchError, NotReservedError, PeerLostError,
                     ReservationExpiredError, StalePeerError, TransferError, TransferTimeoutError)
from splitserve.kvtransfer.layout import KVLayout

__all__ = [
    "AgentMetadata", "BlockOutOfRangeError", "Connector", "KVLayout", "LayoutMismatchError", "NotReservedError",
    "PeerLostError", "Reservation", "ReservationExpiredError", "StalePeerError", "TransferError",
    "TransferHandle", "TransferTimeoutError", "make_connector",
]
