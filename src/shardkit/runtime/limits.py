"""How long a world's job may run, as a number (no torch: the command line prints it in its help
before anything is imported)."""

#: A job still running after this is stopped, with every unfinished rank's stack (seconds).
DEFAULT_TIMEOUT_S = 30 * 60.0
