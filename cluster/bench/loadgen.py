"""The old home of the fleet benchmarks' helpers, now one module per job (client, launcher,
metrics, machine, stats, workloads). Only `first_free_port` is still imported from here,
by tests outside the bench package (tests/e2e/test_tensor_parallel_serve.py,
tests/cluster/test_dashboard.py); new code imports it from `.launcher`."""

from __future__ import annotations

from .launcher import first_free_port

__all__ = ["first_free_port"]
