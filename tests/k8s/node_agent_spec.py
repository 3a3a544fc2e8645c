"""What a container runs, as kubelet works it out: argv, environment, probes.

Test infrastructure, part of the stand-in for kubelet + container runtime
(node_agent.py). Pure functions over the pod object (a dict, as the apiserver
returns it) plus the ConfigMaps/Secrets they reference:

- `resolve_env`: `env` in order — plain values with `$(VAR)` expanded against
  the variables defined before them, `valueFrom.fieldRef` (metadata.name,
  metadata.namespace, metadata.uid, metadata.labels/annotations['k'],
  spec.nodeName, spec.serviceAccountName, status.podIP, status.hostIP),
  `configMapKeyRef`, `secretKeyRef` (with `optional`) — after `envFrom`.
- `container_argv`: `command` + `args` with `$(VAR)` expanded; with no
  `command`, the image's entrypoint. There is no image: the process runs the
  host's programs (the stand-in for the image), and every image's entrypoint is
  `splitserve` (our image's) unless the agent is told otherwise.
- `expand`: Kubernetes' own expansion rules (third_party/forked/golang/expansion):
  `$(VAR)` becomes its value when VAR is defined and stays verbatim otherwise,
  `$$` is a literal `$`.
- `Probe`: a probe's settings with Kubernetes' defaults.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_ENTRYPOINT = ("splitserve",)


class EnvResolutionError(RuntimeError):
    """A referenced ConfigMap/Secret key is missing and not optional (kubelet: CreateContainerConfigError)."""


def expand(text: str, env: dict[str, str]) -> str:
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:
                out.append(text[i:])
                break
            name = text[i + 2:end]
            out.append(env[name] if name in env else text[i:end + 1])
            i = end + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def field_value(pod: dict[str, Any], path: str) -> str:
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {}) or {}
    m = _SUBSCRIPT.match(path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"), "status.hostIP": status.get("hostIP"),
    }
    if path not in simple:
        raise EnvResolutionError(f"fieldRef {path!r} is not supported by the test node agent")
    return simple[path] or ""


# (kind, name) -> the object's data (Secrets decoded), or None when it does not exist.
Lookup = Callable[[str, str], dict[str, str] | None]


def _from_object(kind: str, ref: dict[str, Any], lookup: Lookup) -> str | None:
    data = lookup(kind, ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise EnvResolutionError(f"{kind} {ref['name']!r} has no key {ref['key']!r}")
    return data[ref["key"]]


def resolve_env(pod: dict[str, Any], container: dict[str, Any], lookup: Lookup) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        kind, ref = (("ConfigMap", source["configMapRef"]) if "configMapRef" in source
                     else ("Secret", source["secretRef"]))
        data = lookup(kind, ref["name"])
        if data is None:
            if ref.get("optional"):
                continue
            raise EnvResolutionError(f"{kind} {ref['name']!r} not found")
        env.update({source.get("prefix", "") + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        name, value_from = var["name"], var.get("valueFrom")
        if value_from is None:
            env[name] = expand(var.get("value", ""), env)
        elif "fieldRef" in value_from:
            env[name] = field_value(pod, value_from["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in value_from:
            value = _from_object("ConfigMap", value_from["configMapKeyRef"], lookup)
            if value is not None:
                env[name] = value
        elif "secretKeyRef" in value_from:
            value = _from_object("Secret", value_from["secretKeyRef"], lookup)
            if value is not None:
                env[name] = value
        else:
            raise EnvResolutionError(f"env {name}: {sorted(value_from)} is not supported by the test node agent")
    return env


def decode_secret(data: dict[str, str] | None) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (data or {}).items()}


def container_argv(container: dict[str, Any], env: dict[str, str],
                   entrypoints: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    command = container.get("command")
    if not command:
        command = list((entrypoints or {}).get(container.get("image", ""), DEFAULT_ENTRYPOINT))
    return [expand(a, env) for a in [*command, *(container.get("args") or [])]]


@dataclass(slots=True)
class Probe:
    """One probe with Kubernetes' defaults filled in."""

    handler: dict[str, Any]         # the exec/httpGet/tcpSocket/grpc part
    kind: str                       # "exec" | "httpGet" | "tcpSocket" | "grpc"
    initial_delay: float
    period: float
    timeout: float
    success_threshold: int
    failure_threshold: int
    termination_grace: float | None

    @classmethod
    def from_spec(cls, spec: dict[str, Any] | None) -> Probe | None:
        if not spec:
            return None
        kind = next((k for k in ("exec", "httpGet", "tcpSocket", "grpc") if k in spec), None)
        if kind is None:
            raise EnvResolutionError(f"probe without a handler: {spec}")
        return cls(handler=spec[kind], kind=kind, initial_delay=spec.get("initialDelaySeconds", 0),
                   period=spec.get("periodSeconds", 10), timeout=spec.get("timeoutSeconds", 1),
                   success_threshold=spec.get("successThreshold", 1),
                   failure_threshold=spec.get("failureThreshold", 3),
                   termination_grace=spec.get("terminationGracePeriodSeconds"))


def resolve_port(port: int | str, container: dict[str, Any]) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise EnvResolutionError(f"container {container['name']!r} has no port named {port!r}")
