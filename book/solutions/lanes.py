"""Exercise 8.4, a reference solution.  Run it: python book/solutions/lanes.py

Rank i of every group holds the same slice of the model, shard i, so the average across groups
can run lane by lane. Cut one group into 3 shards and the others into 2, and rank 1 of the first
holds elements [3, 6) of an 8-element gradient where rank 1 of the others holds [4, 8): lane 1
would add numbers of other parameters (here even of other lengths; with sizes that happen to
match, silently the wrong ones). That is why the group size is a setting every group must share,
and a group of another size is refused at admission.
"""
import torch


def average_by_lanes(shards):
    """shards[g][i]: rank i's shard of group g's gradient -> the same after each lane's average."""
    lanes = list(zip(*shards))  # lane i: rank i of every group
    means = [sum(lane) / len(lane) for lane in lanes]
    return [[m.clone() for m in means] for _ in shards]


if __name__ == "__main__":
    grads = [torch.arange(8.0), 3 * torch.arange(8.0)]
    averaged = average_by_lanes([g.chunk(2) for g in grads])
    whole = sum(grads) / len(grads)
    for group in averaged:
        assert all(torch.equal(mine, part) for mine, part in zip(group, whole.chunk(2)))
    two, three = grads[0].chunk(2), grads[1].chunk(3)
    print("rank 1 of a group of 2 holds", two[1].tolist(), "; of a group of 3:", three[1].tolist())
