"""Kubernetes operator: CRD types, kopf reconcilers, gang scheduler (issue 7).

Imported only as `splitserve.operator`; `operator` alone is the standard library.
"""
