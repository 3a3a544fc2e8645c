"""Kubernetes operator: the ServingDeployment CRD types, the reconciler (kopf),
the `splitserve-gang` gang scheduler, health and drain (operator/README.md).

Imported only as `splitserve.operator`; `operator` alone is the standard library.
`spec` has no Kubernetes dependency (Ray reads the same spec); the rest needs
kopf and the kubernetes client, imported only where used.
"""
