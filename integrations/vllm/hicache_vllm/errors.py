"""The one error hicache-vllm raises for what it does not serve."""


class NotServedError(RuntimeError):
    """A vLLM version, model or configuration hicache-vllm does not serve; the message says what would work."""
