"""A pod's volumes on the test node agent: their files, and the mounts that put them in place.

Test infrastructure, part of the stand-in for kubelet + container runtime
(node_agent.py). kubelet writes each volume of a pod into a folder of its own
and the runtime mounts it at each `volumeMount.mountPath` of the container. The
agent does the same: `materialize()` writes the volumes under the pod's work
folder, and `mount_wrapper()` gives the argv prefix that, inside the private
mount namespace `ip netns exec` already makes for the container (it mounts `/`
rslave, so nothing propagates back to the host), bind-mounts each folder at
its mount path before exec-ing the container's command (mount_steps(), run by
the pod's wrapper in node_agent_pod.py). There is no image:
the container's root is the host's, so a mount path that does not exist is
created there as an empty directory (the mount point), as a runtime creates
mount points in an image's root filesystem.

Kinds: `emptyDir`, `secret`, `configMap` (with `items` and `optional`),
`downwardAPI` and `projected` of those plus `serviceAccountToken` — the last
is what the apiserver's ServiceAccount admission adds to every pod
(`kube-api-access-*`: a bound token, `kube-root-ca.crt`'s ca.crt, the
namespace), so in-cluster clients in agent pods log in as their
ServiceAccount, through the chart's RBAC. Tokens are requested once, at
container start (an hour's validity outlives any test).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent_spec import EnvResolutionError, Lookup, field_value

# (service account, audience or None, expiration seconds, pod) -> a bound token
TokenSource = Callable[[str, str | None, int, dict[str, Any]], str]


@dataclass(frozen=True, slots=True)
class Mount:
    source: Path
    target: str
    read_only: bool
    sub_path: str = ""


def _object_files(kind: str, spec: dict[str, Any], lookup: Lookup) -> dict[str, bytes]:
    """The files of a secret/configMap volume (or projection): each key, or only `items`."""
    name = spec.get("secretName") if kind == "Secret" and "secretName" in spec else spec.get("name")
    data = lookup(kind, name)
    if data is None:
        if spec.get("optional"):
            return {}
        raise EnvResolutionError(f"volume: {kind} {name!r} not found")
    as_bytes = {k: (v if isinstance(v, bytes) else v.encode()) for k, v in data.items()}
    items = spec.get("items")
    if not items:
        return as_bytes
    out: dict[str, bytes] = {}
    for item in items:
        if item["key"] not in as_bytes:
            if spec.get("optional"):
                continue
            raise EnvResolutionError(f"volume: {kind} {name!r} has no key {item['key']!r}")
        out[item["path"]] = as_bytes[item["key"]]
    return out


def _downward_files(spec: dict[str, Any], pod: dict[str, Any]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for item in spec.get("items") or []:
        if "fieldRef" not in item:
            raise EnvResolutionError(f"downwardAPI {item['path']}: only fieldRef is supported by the test node agent")
        out[item["path"]] = field_value(pod, item["fieldRef"]["fieldPath"]).encode()
    return out


def volume_files(volume: dict[str, Any], pod: dict[str, Any], lookup: Lookup,
                 token: TokenSource) -> dict[str, bytes] | None:
    """The files of one volume (relative path -> content); None for an emptyDir."""
    if "emptyDir" in volume:
        return None
    if "secret" in volume:
        return _object_files("Secret", volume["secret"], lookup)
    if "configMap" in volume:
        return _object_files("ConfigMap", volume["configMap"], lookup)
    if "downwardAPI" in volume:
        return _downward_files(volume["downwardAPI"], pod)
    if "projected" in volume:
        files: dict[str, bytes] = {}
        for source in volume["projected"].get("sources") or []:
            if "serviceAccountToken" in source:
                sat = source["serviceAccountToken"]
                account = pod["spec"].get("serviceAccountName") or "default"
                files[sat["path"]] = token(account, sat.get("audience"), sat.get("expirationSeconds", 3600),
                                           pod).encode()
            elif "configMap" in source:
                files.update(_object_files("ConfigMap", source["configMap"], lookup) or {})
            elif "secret" in source:
                files.update(_object_files("Secret", source["secret"], lookup) or {})
            elif "downwardAPI" in source:
                files.update(_downward_files(source["downwardAPI"], pod))
            else:
                raise EnvResolutionError(f"projected source {sorted(source)} is not supported by the test node agent")
        return files
    kinds = sorted(k for k in volume if k != "name")
    raise EnvResolutionError(f"volume {volume['name']!r}: {kinds} is not supported by the test node agent")


def materialize(pod: dict[str, Any], root: Path, lookup: Lookup, token: TokenSource) -> dict[str, Path]:
    """Write every volume of the pod under `root`; volume name -> its folder."""
    folders: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        folder = root / volume["name"]
        files = volume_files(volume, pod, lookup, token)
        folder.mkdir(parents=True, exist_ok=True)
        for rel, content in (files or {}).items():
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            path.chmod(0o644)
        folders[volume["name"]] = folder
    return folders


def container_mounts(container: dict[str, Any], folders: dict[str, Path]) -> list[Mount]:
    mounts: list[Mount] = []
    for vm in container.get("volumeMounts") or []:
        if vm["name"] not in folders:
            raise EnvResolutionError(f"volumeMount {vm['name']!r}: the pod has no such volume")
        mounts.append(Mount(folders[vm["name"]], vm["mountPath"], bool(vm.get("readOnly")), vm.get("subPath", "")))
    return mounts


def python_environment() -> list[str]:
    """The folders the pods' commands run from: the interpreter of the tests (a pod's
    `splitserve` is that environment's script), its prefixes and every import path (an
    editable install's source tree among them). There is no image here, so a volume mounted
    over a folder that holds one of them (an emptyDir at /tmp over a venv in /tmp) must leave
    them in place."""
    paths = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             *(p for p in sys.path if p and os.path.isdir(p))}
    outermost = sorted({os.path.realpath(p) for p in paths}, key=len)
    kept: list[str] = []
    for path in outermost:
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def mount_steps(mounts: list[Mount], keep: Iterable[str] = ()) -> list[str]:
    """Shell steps that bind-mount each folder at its path (run in the container's mount
    namespace). A folder of `keep` that a mount would hide is bound into the mount's source
    first and the mount brings it along (--rbind), so it stays visible at its own path."""
    steps: list[str] = []
    keep = list(keep)
    # A mount over a folder that holds volumes' sources (an emptyDir at /tmp, the agent's work
    # folder being under /tmp) would hide them: such mounts go last.
    hides = lambda m: any(str(o.source).startswith(m.target.rstrip("/") + "/") for o in mounts)  # noqa: E731
    for m in sorted(mounts, key=hides):
        source = m.source / m.sub_path if m.sub_path else m.source
        target = shlex.quote(m.target)
        if source.is_dir():
            steps.append(f"mkdir -p {target}")
        else:                          # a subPath file: its mount point is a file
            steps.append(f"mkdir -p $(dirname {target}) && touch {target}")
        hidden = [k for k in keep if source.is_dir() and k.startswith(m.target.rstrip("/") + "/")]
        for path in hidden:
            inside = shlex.quote(str(source / os.path.relpath(path, m.target)))
            steps += [f"mkdir -p {inside}", f"mount --bind {shlex.quote(path)} {inside}"]
        steps.append(f"mount {'--rbind' if hidden else '--bind'} {shlex.quote(str(source))} {target}")
        if m.read_only:
            steps.append(f"mount -o remount,bind,ro {target}")
    return steps
