"""A wrong answer to exercise 7.1: writes and reads a path of its own, whatever path it is given."""
import torch

MINE = "my_checkpoint.pt"  # one place for every checkpoint


def save_checkpoint(path, model, optimizer, step):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                "step": step}, MINE)


def load_checkpoint(path, model, optimizer):
    state = torch.load(MINE, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return state["step"]
