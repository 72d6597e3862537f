"""Errors the CLI turns into a clear message and exit code 2 before anything starts."""


class ConfigError(ValueError):
    """Bad user input: names the file and field, what was expected and the valid choices."""
