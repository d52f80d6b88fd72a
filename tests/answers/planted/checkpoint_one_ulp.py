"""Saves every weight one float32 step (one ulp) above its value: the smallest change a bitwise resume must refuse."""
import torch


def save_checkpoint(path, model, optimizer, step):
    weights = {k: torch.nextafter(v, torch.full_like(v, float("inf"))) if v.is_floating_point() else v
               for k, v in model.state_dict().items()}
    torch.save({"model": weights, "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(), "step": step},
               path)


def load_checkpoint(path, model, optimizer):
    state = torch.load(path, weights_only=True)
    for key, put in (("model", model.load_state_dict), ("optimizer", optimizer.load_state_dict),
                     ("rng", torch.set_rng_state)):
        put(state[key])
    return state["step"]
