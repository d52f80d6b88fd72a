"""A wrong answer to exercise 3.1: the right sum, handed back rounded to float32 (7 digits, where the grader asks 9)."""
import torch

from manualdp.schedule import chunk_sizes


def cost(schedule, nbytes, alpha, beta, gamma):
    n, sizes = schedule.num_devices, chunk_sizes(nbytes, schedule.num_chunks)
    total = 0.0
    for rnd in schedule.rounds:
        sent, received, added = [0] * n, [0] * n, [0] * n
        peers_out, peers_in = [set() for _ in range(n)], [set() for _ in range(n)]
        for t in rnd:
            sent[t.src] += sizes[t.chunk]
            received[t.dst] += sizes[t.chunk]
            if t.reduce:
                added[t.dst] += sizes[t.chunk]
            peers_out[t.src].add(t.dst)
            peers_in[t.dst].add(t.src)
        total += max((alpha * max(len(peers_out[d]), len(peers_in[d])) + beta * max(sent[d], received[d])
                      + gamma * added[d] for d in range(n)), default=0.0)
    return float(torch.tensor(total, dtype=torch.float32))
