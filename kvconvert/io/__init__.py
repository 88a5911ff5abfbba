"""Checkpoint input (Hub or local, streaming) and output (atomic directory, streaming safetensors)."""
