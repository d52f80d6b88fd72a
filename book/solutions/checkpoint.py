"""Exercise 7.1, a reference solution.  Check it: manualdp check checkpoint book/solutions/checkpoint.py"""
import torch


def save_checkpoint(path, model, optimizer, step):
    """Everything the run's next steps depend on: weights, the optimizer's state, the random number generator."""
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                "step": step}, path)


def load_checkpoint(path, model, optimizer):
    """Put the saved state into a fresh `model` and `optimizer`; return the number of steps done."""
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return state["step"]
