"""Model analysis on the meta device: explain, estimate, automatic splits."""
