"""Data and checkpoints: file-sharded text data, sharded checkpoints."""
