"""The training face: one import for a training script."""
