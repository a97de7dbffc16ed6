"""Converting checkpoints into plain Transformers folders (GGUF today)."""
