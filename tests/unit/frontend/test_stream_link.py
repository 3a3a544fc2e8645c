"""StreamLink's flow control against a real socket whose other end never reads (a stuck worker)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.proto.v1 import worker_pb2
from splitserve.services.frontend.workers.session import StreamLink, WorkerCallError, _Requests

BIG = worker_pb2.SessionRequest(generate=worker_pb2.TokenGenerateRequest(request_id="big",
                                                                          token_ids=list(range(50_000, 150_000))))


def test_a_worker_that_stops_reading_holds_up_new_requests_until_the_link_breaks():
    async def main():
        peers: list[asyncio.StreamWriter] = []
        server = await asyncio.start_server(lambda _reader, writer: peers.append(writer), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        requests = _Requests("stuck")
        link = await StreamLink.open("127.0.0.1", port, None, None, requests)
        link._transport.set_write_buffer_limits(high=64 * 1024)
        blocked = None
        for _ in range(2000):                    # the kernel's socket buffers fill first
            write = asyncio.ensure_future(link.write(BIG))
            await asyncio.sleep(0)
            if not write.done():
                blocked = write
                break
        assert blocked is not None, "the writes never waited"
        buffered = link._transport.get_write_buffer_size()
        await asyncio.wait_for(link.write(worker_pb2.SessionRequest(abort_request_id="big")), 1)
        for peer in peers:
            peer.transport.abort()               # the stuck worker goes away
        with pytest.raises(WorkerCallError) as cut:
            await asyncio.wait_for(blocked, 5)
        server.close()
        return buffered, cut.value, requests.failure

    buffered, cut, failure = asyncio.run(main())
    assert buffered < 2 * 64 * 1024 + len(BIG.SerializeToString()) + 4
    assert cut.code() == grpc.StatusCode.UNAVAILABLE and failure is cut
