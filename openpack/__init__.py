"""openpack: packed SFT, reward-model, DPO and RLHF training on Ray + DeepSpeed."""

__version__ = "0.1.0"
