"""A careless answer to exercise 3.1: the beta term counts the bytes a device sends and forgets those it receives."""
from manualdp.schedule import chunk_sizes


def cost(schedule, nbytes, alpha, beta, gamma):
    n, sizes = schedule.num_devices, chunk_sizes(nbytes, schedule.num_chunks)
    total = 0.0
    for rnd in schedule.rounds:
        sent, added = [0] * n, [0] * n
        peers_out, peers_in = [set() for _ in range(n)], [set() for _ in range(n)]
        for t in rnd:
            sent[t.src] += sizes[t.chunk]
            added[t.dst] += sizes[t.chunk] if t.reduce else 0
            peers_out[t.src].add(t.dst)
            peers_in[t.dst].add(t.src)
        total += max((alpha * max(len(peers_out[d]), len(peers_in[d])) + beta * sent[d] + gamma * added[d]
                      for d in range(n)), default=0.0)
    return total
