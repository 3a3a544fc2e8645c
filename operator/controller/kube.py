"""A small JSON REST layer over the official `kubernetes` client.

The client (37.x) brings configuration, authentication, TLS and connection
pooling; its generated pydantic models are strict and verbose, and its typed
Binding call cannot parse the apiserver's reply, so the operator talks plain
JSON documents through `ApiClient.param_serialize` / `call_api` instead. Calls
are blocking; async code runs them with `asyncio.to_thread` (see `AsyncKube`).
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT_S = 15.0


class KubeError(Exception):
    """The apiserver refused a request (`status` is its HTTP status)."""

    def __init__(self, status: int, method: str, path: str, message: str):
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


def load_api_client(kubeconfig: str | Path | None = None) -> kubernetes.client.ApiClient:
    """An ApiClient from `kubeconfig`, else in-cluster service account, else ~/.kube/config."""
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_incluster_config(client_configuration=configuration)
        return kubernetes.client.ApiClient(configuration)
    return kubernetes.config.new_client_from_config(config_file=str(kubeconfig) if kubeconfig else None)


@dataclass(slots=True)
class Kube:
    """Blocking JSON calls: `request("GET", "/api/v1/nodes")` returns the decoded document."""

    api_client: kubernetes.client.ApiClient

    def request(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None,
                content_type: str = JSON) -> dict[str, Any]:
        headers = {"Accept": JSON}
        if body is not None:
            headers["Content-Type"] = content_type
        params = self.api_client.param_serialize(
            method=method, resource_path=path, query_params=list((query or {}).items()),
            header_params=headers, body=body, auth_settings=["BearerToken"])
        response = self.api_client.call_api(*params, _request_timeout=REQUEST_TIMEOUT_S)
        data = response.read()
        if not 200 <= response.status < 300:
            try:
                message = json.loads(data).get("message", "")
            except ValueError:
                message = data[:500].decode(errors="replace")
            raise KubeError(response.status, method, path, message)
        return json.loads(data) if data else {}


class AsyncKube:
    """The same calls for asyncio code, each on a worker thread."""

    def __init__(self, kube: Kube):
        self.kube = kube

    async def request(self, method: str, path: str, body: Any = None, query: dict[str, Any] | None = None,
                      content_type: str = JSON) -> dict[str, Any]:
        return await asyncio.to_thread(self.kube.request, method, path, body, query, content_type)

    async def list(self, path: str, label_selector: str | None = None,
                   field_selector: str | None = None) -> list[dict[str, Any]]:
        query = {}
        if label_selector:
            query["labelSelector"] = label_selector
        if field_selector:
            query["fieldSelector"] = field_selector
        return (await self.request("GET", path, query=query or None)).get("items", [])

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            return await self.request("GET", path)
        except KubeError as exc:
            if exc.not_found:
                return None
            raise

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, body)

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return await self.request("PATCH", path, patch, content_type=MERGE_PATCH)

    async def delete(self, path: str, grace_period_s: int | None = None) -> bool:
        """Delete; False when it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if grace_period_s is not None:
            body["gracePeriodSeconds"] = grace_period_s
        try:
            await self.request("DELETE", path, body)
            return True
        except KubeError as exc:
            if exc.not_found:
                return False
            raise


# --- paths ---------------------------------------------------------------------------------

def core_path(namespace: str | None, plural: str, name: str | None = None, sub: str | None = None) -> str:
    path = "/api/v1" + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def group_path(group: str, version: str, namespace: str | None, plural: str, name: str | None = None,
               sub: str | None = None) -> str:
    path = f"/apis/{group}/{version}" + (f"/namespaces/{namespace}" if namespace else "") + f"/{plural}"
    return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")
