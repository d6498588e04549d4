"""Checkpoints and HuggingFace weights: sharded state in and out, between plans."""
