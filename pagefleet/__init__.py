"""pagefleet: a paged-KV, continuously batched LLM engine, served as a fleet on Ray."""

__version__ = "0.1.0"
