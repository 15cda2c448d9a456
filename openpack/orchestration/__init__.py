"""Launching workers: in this process, or one Ray actor per rank in a placement group."""
