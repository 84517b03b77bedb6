"""Small models kept in the repository for tests, examples and the demo (random init, no
downloads)."""
from .llama import Llama, LlamaConfig, LlamaOutput

__all__ = ["Llama", "LlamaConfig", "LlamaOutput"]
