"""One rank of test_nonfinite.py's injected step, under torchrun: ``python nonfinite_script.py STEP TRAIN_SFT_ARGS...``.

Runs ``openpack train_sft`` as a user would, except that on rank 1 only, in the first micro-batch of optimizer
step STEP, one per-token log-prob is replaced by -inf: that rank's loss is inf, its gradients stay finite (the
replaced entry passes no gradient), and no other rank sees anything wrong but through the step's reduction.
"""

import sys

import torch

import openpack.trainers.sft_worker as sft_worker
from openpack.cli import train_sft


def main() -> int:
    bad_step, argv = int(sys.argv[1]), sys.argv[2:]
    steps = {"taken": 0}
    train_step = sft_worker.train_step

    def injected(engine, *args, **kwargs):
        steps["taken"] += 1
        if steps["taken"] == bad_step and torch.distributed.get_rank() == 1:
            forward = engine.forward

            def one_inf(*f_args, **f_kwargs):
                del engine.forward  # the next micro-batch runs the engine's own forward again
                logps = forward(*f_args, **f_kwargs)
                first = torch.zeros_like(logps, dtype=torch.bool).reshape(-1)
                first[0] = True
                return torch.where(first.reshape(logps.shape), float("-inf"), logps)

            engine.forward = one_inf
        return train_step(engine, *args, **kwargs)

    sft_worker.train_step = injected
    return train_sft.main(argv)


if __name__ == "__main__":
    sys.exit(main())
