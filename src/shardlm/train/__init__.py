"""Training: sharded state creation, the jitted step, the loop and its metrics."""
