"""A wrong answer to exercise 7.1: the weights and the optimizer's state, but not the random number generator."""
import torch


def save_checkpoint(path, model, optimizer, step):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path)


def load_checkpoint(path, model, optimizer):
    state = torch.load(path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]
