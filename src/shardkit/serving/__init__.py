"""Serving a sharded model: the engine every rank runs (continuous batching over the sharded model)
and the OpenAI-compatible HTTP server on rank 0, meeting only at :mod:`.requests`."""
