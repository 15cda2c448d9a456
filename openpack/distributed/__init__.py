"""Process groups, the DeepSpeed engine and checkpoints: everything that knows about ranks."""
