"""Checkpoints: written whole, the latest kept, read back with the state to resume exactly."""
