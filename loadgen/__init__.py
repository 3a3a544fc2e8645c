"""Workloads, load generator, metrics, reports and plots (issue 5)."""
