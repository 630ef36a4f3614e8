"""pagefleet's lab: the fleet simulator and the research benchmarks (development only).

It imports the product (`pagefleet`) and is never imported by it (an import-linter
contract in the repository's pyproject.toml). `pagefleet-lab --help` lists its commands.
"""
