"""Pure-torch building blocks: packing planner, PackedBatch, log-probs. Imports only torch and numpy."""
