"""User-facing errors: the CLI prints their message on one line and exits with status 2."""


class EpiKVError(ValueError):
    """A bad input or setting, explained in one line (never a traceback for the user)."""


class ContextWarning(UserWarning):
    """A generation that reaches positions past the model's trained context (max_position_embeddings). `kind`:
    "prompt" (the prompt alone is longer) or "cache" (the cache may grow past the context)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class DefaultFallbackWarning(ContextWarning):
    """No policy was named and the default cannot run on this model (its learned weights were fitted on other
    models, or its layers are sliding-window): the fallback runs instead (`epikv.policies.for_model`). The CLI prints
    it as one line."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "default-fallback")
