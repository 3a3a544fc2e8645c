"""Routing policies, one module each, behind the `Policy` interface (policies/base.py)."""

from __future__ import annotations

from splitserve.router.policies.base import Candidate, CandidateTable, Decision, Policy, Scored
from splitserve.router.policies.kv import DEFAULT_PREFILL_WEIGHT, KvPolicy, kv_cost
from splitserve.router.policies.least_loaded import LeastLoadedPolicy
from splitserve.router.policies.power_of_two import PowerOfTwoPolicy
from splitserve.router.policies.random_choice import RandomPolicy
from splitserve.router.policies.round_robin import RoundRobinPolicy

POLICIES = {p.name: p for p in (KvPolicy, RoundRobinPolicy, RandomPolicy, LeastLoadedPolicy, PowerOfTwoPolicy)}


def make_policy(name: str, seed: int | None = None, prefill_weight: float = DEFAULT_PREFILL_WEIGHT,
                temperature: float = 0.0) -> Policy:
    """A policy by its CLI name; ValueError for an unknown one."""
    if name not in POLICIES:
        raise ValueError(f"unknown router policy {name!r}; choose one of {', '.join(POLICIES)}")
    if name == "kv":
        return KvPolicy(prefill_weight, temperature, seed)
    return POLICIES[name](seed=seed)


__all__ = ["Candidate", "CandidateTable",
           "Decision", "Policy", "Scored", "KvPolicy", "kv_cost", "make_policy", "POLICIES",
           "DEFAULT_PREFILL_WEIGHT"]
