"""`paro-jax inspect`: a step compiled from abstract inputs and its communication reported."""
