"""A wrong answer to exercise 7.1: the weights saved in float16 to halve the file; the resumed run is close to the
uninterrupted one, not equal to it."""
import torch


def save_checkpoint(path, model, optimizer, step):
    weights = {k: v.half() for k, v in model.state_dict().items()}
    torch.save({"model": weights, "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(), "step": step},
               path)


def load_checkpoint(path, model, optimizer):
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])  # copied into the float32 parameters
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return state["step"]
