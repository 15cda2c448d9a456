"""Dataset loading, chat templates, tokenization and the built-in demo task."""
