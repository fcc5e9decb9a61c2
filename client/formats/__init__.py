"""Checkpoint formats: one module each, named in one table (:data:`FORMATS`)."""
