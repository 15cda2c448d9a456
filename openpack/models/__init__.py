"""Hugging Face model loading and the segment-isolated (varlen) attention backends."""
