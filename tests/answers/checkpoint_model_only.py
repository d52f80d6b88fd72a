"""A wrong answer to exercise 7.1: saves the weights and the step, as most first tries do, and nothing else."""
import torch


def save_checkpoint(path, model, optimizer, step):
    torch.save({"model": model.state_dict(), "step": step}, path)


def load_checkpoint(path, model, optimizer):
    state = torch.load(path)
    model.load_state_dict(state["model"])
    return state["step"]
