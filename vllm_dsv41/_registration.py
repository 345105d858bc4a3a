"""Plugin registration (placeholder until the vLLM model lands)."""


def register() -> None:
    return None
