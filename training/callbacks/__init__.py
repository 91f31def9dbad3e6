"""Callbacks a model author sets in YAML: early stopping, monitor and unused-parameter checks, progress, predictions."""
