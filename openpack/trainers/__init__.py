"""Training loops: sft, dpo, ...; each composes core parts and never branches on packing."""
