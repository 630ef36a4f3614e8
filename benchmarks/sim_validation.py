"""Issue 22's validation report: a real `pagefleet-lab router` run beside the simulator's
run of the same workloads (`pagefleet_lab.sim.validation`, whose docstring
says what is compared).

    .venv/bin/python benchmarks/sim_validation.py \\
        --real benchmarks/results/router_validation.json \\
        --sim benchmarks/results/sim_router_validation.json \\
        --out benchmarks/results/sim_validation

Writes OUT.md, OUT.png and OUT.json; exits 1 when the validation does not hold.
"""

from __future__ import annotations

import sys

from pagefleet_lab.sim.validation import main

if __name__ == "__main__":
    sys.exit(main())
