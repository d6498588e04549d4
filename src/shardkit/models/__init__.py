"""Reference models and ready-made layout rule sets."""
