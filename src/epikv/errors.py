"""User-facing errors: the CLI prints their message on one line and exits with status 2."""


class EpiKVError(ValueError):
    """A bad input or setting, explained in one line (never a traceback for the user)."""
