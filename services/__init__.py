"""The processes and their parts: cli, launch, wire, text, engine, worker, frontend, ray_serve.

services/README.md and docs/architecture.md give each folder's one job.
"""
