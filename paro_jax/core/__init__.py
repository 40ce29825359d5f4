"""The engine: strategies, mesh, sharding, collectives and the training step."""
