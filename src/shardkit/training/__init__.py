"""A training job: one typed configuration (:class:`~shardkit.training.config.TrainConfig`, from a job file
and flags in one place), the plan flags made a Plan once, the checks before launch, one rank's loop, and
``sk.train(config)`` that runs them. ``shardkit train`` only parses its flags into a ``TrainConfig``,
calls it and prints. Modules are imported by name (``shardkit.training.run``), nothing here.
"""
