"""kvcached: an elastic KV cache for LLM serving on shared GPUs (NVIDIA and AMD)."""

from kvcached.errors import KVCachedConfigError, KVCachedError, KVCachedStateError, KVCachePoolExhausted

__version__ = "0.1.0"
__all__ = ["KVCachedConfigError", "KVCachedError", "KVCachePoolExhausted", "KVCachedStateError", "__version__"]
