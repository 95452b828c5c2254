"""Exceptions that the command line turns into a one-line message and exit code 2."""


class UsageError(Exception):
    """Bad input from the user (options, files, environment): exit 2, no traceback."""
