from .registry import ModelSpec, resolve_model

__all__ = ["ModelSpec", "resolve_model"]
