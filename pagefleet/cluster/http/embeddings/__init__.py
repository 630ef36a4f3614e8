"""`/v1/embeddings`: the request body, the route, and the work behind it."""

from .router import router
from .serving import EmbeddingServing

__all__ = ["EmbeddingServing", "router"]
