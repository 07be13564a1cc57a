"""User-facing errors: the CLI prints their message on one line and exits with status 2."""


class EpiKVError(ValueError):
    """A bad input or setting, explained in one line (never a traceback for the user)."""


class ContextWarning(UserWarning):
    """A generation that reaches positions past the model's trained context (max_position_embeddings). `kind`:
    "prompt" (the prompt alone is longer) or "cache" (the cache may grow past the context)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind
