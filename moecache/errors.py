"""The one error type the CLI turns into a clear one-line message and a non-zero exit."""


class MoecacheError(Exception):
    """Bad input or an impossible request. The message names the file, key or value at fault."""
