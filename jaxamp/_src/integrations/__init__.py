"""Framework integrations: train steps, gradient accumulation, nnx modules and state trees."""
