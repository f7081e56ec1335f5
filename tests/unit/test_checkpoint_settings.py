"""checkpoint.load_optimizer_state: a resumed optimizer keeps the moments and step counts of the
checkpoint and the settings it was built with (torch's load_state_dict alone restores the saved ones,
so `optimizer.weight_decay=0.5` on resume trained like 0.0)."""
import torch

from megatron_cispo.runner.checkpoint import load_optimizer_state


def _trained(betas, weight_decay):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p], lr=0.1, betas=betas, weight_decay=weight_decay)
    for _ in range(3):
        opt.zero_grad()
        (p ** 2).sum().backward()
        opt.step()
    return p, opt


def test_the_loaded_state_is_the_checkpoints_and_the_settings_stay_the_configs():
    _, saved = _trained((0.9, 0.999), 0.0)
    p, now = _trained((0.5, 0.99), 0.5)  # built from a changed config
    load_optimizer_state(now, saved.state_dict())
    group = now.param_groups[0]
    assert group["betas"] == (0.5, 0.99) and group["weight_decay"] == 0.5
    assert torch.equal(now.state[p]["exp_avg"], saved.state[saved.param_groups[0]["params"][0]]["exp_avg"])
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], betas=(0.5, 0.99), weight_decay=0.5)
    plain.load_state_dict(saved.state_dict())
    assert plain.param_groups[0]["betas"] == (0.9, 0.999)  # what happened before: the saved settings won
