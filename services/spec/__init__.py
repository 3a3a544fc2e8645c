"""The ServingDeployment spec as typed dataclasses, with no Kubernetes dependency: what the operator
reconciles and what the Ray Serve target reads from the same YAML."""
