"""mpigrad's own exceptions: bad input (the command line turns it into a one-line message
and exit code 2) and a run that cannot go on."""


class UsageError(Exception):
    """Bad input from the user (options, files, environment): exit 2, no traceback."""


class TrainingError(RuntimeError):
    """The run cannot go on (non-finite values, diverged replicas, a bad frame)."""
