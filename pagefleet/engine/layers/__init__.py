"""Model building blocks. Tensor-parallel sharding lives here, in the layers."""
