"""What the picker's two Kubernetes readers share: the API client (in-cluster, else KUBECONFIG) and
one thread that lists and watches with the synchronous client, started on and stopped from the
event loop. `PoolPods` (the pool's pods) and `ObjectiveWatch` (its InferenceObjectives) each write
`_run(loop)`, handing what they read to the loop with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


def kube_api_client():
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()     # outside a cluster: KUBECONFIG or ~/.kube/config
    return client.ApiClient()


class WatchThread:
    """Runs `_run(loop)` on a thread until `close()`; `_stop` tells it to end (at the latest when
    its current watch window, `window_s`, ends)."""

    def __init__(self, window_s: int, api_client=None):
        self.window_s = window_s
        self._api = api_client            # None: made at start()
        self._stop = threading.Event()
        self._thread: asyncio.Future | None = None

    async def start(self) -> None:
        if self._api is None:
            self._api = kube_api_client()
        loop = asyncio.get_running_loop()
        self._thread = loop.run_in_executor(None, self._run, loop)

    async def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._thread), self.window_s + 5)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        raise NotImplementedError
