"""Measurements of converted checkpoints (memory now; quality and speed arrive with `kvconvert eval`)."""
