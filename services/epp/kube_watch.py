"""What the picker's two Kubernetes readers share: the API client (in-cluster, else KUBECONFIG) and
one thread that lists and watches with the synchronous client, started on and stopped from the
event loop. `PoolPods` (the pool's pods) and `ObjectiveWatch` (its InferenceObjectives) each write
`_run(loop)`, handing what they read to the loop with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import threading


def kube_api_client():
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()     # outside a cluster: KUBECONFIG or ~/.kube/config
    return client.ApiClient()


class WatchThread:
    """Runs `_run(loop)` on its own daemon thread until `close()`; `_stop` tells it to end (at the
    latest when its current watch window, `window_s`, ends). Not on the loop's default executor:
    a watch holds its thread for good, and the executor's few threads also serve the loop's
    short blocking calls."""

    def __init__(self, window_s: int, api_client=None):
        self.window_s = window_s
        self._api = api_client            # None: made at start()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        if self._api is None:
            self._api = kube_api_client()
        loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, args=(loop,), name=type(self).__name__, daemon=True)
        self._thread.start()

    async def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, self.window_s + 5)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        raise NotImplementedError
