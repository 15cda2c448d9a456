"""``ChunkedAdamW`` (the optimizer of every openpack engine) is torch AdamW, bitwise, stepped in chunks."""

import pytest
import torch

from openpack.distributed.engine import ChunkedAdamW


@pytest.mark.parametrize("chunk", [1, 999, 1 << 22])
def test_chunked_steps_equal_torch_adamw_bitwise_with_the_same_state(chunk):
    """Two parameter groups (decay and none), a flat parameter longer than a chunk and a short one, a parameter
    with no gradient, five steps with a changing lr: weights and AdamW state equal bit for bit, state_dict alike."""
    torch.manual_seed(0)
    shapes = [(1000, 37), (5000,), (3, 3)]
    ours = [torch.randn(s, requires_grad=True) for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]

    def groups(params):
        return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]

    settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    mine, reference = ChunkedAdamW(groups(ours), chunk=chunk, **settings), torch.optim.AdamW(groups(theirs), **settings)
    for step in range(5):
        for a, b in zip(ours[:2], theirs[:2]):  # the third parameter never has a gradient
            grad = torch.randn_like(a)
            a.grad, b.grad = grad.clone(), grad.clone()
        for opt in (mine, reference):
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (step + 1)
        mine.step()
        reference.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    state, expected = mine.state_dict(), reference.state_dict()
    assert expected["state"].keys() == state["state"].keys() == {0, 1}
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            assert torch.equal(state["state"][index][key], value), key
            assert state["state"][index][key].dtype == value.dtype
    assert [set(g) for g in state["param_groups"]] == [set(g) for g in expected["param_groups"]]
