"""A wrong answer to exercise 3.1, right for the sizes its author tried: it gives up at 16 devices."""
from manualdp.schedule import chunk_sizes


def cost(schedule, nbytes, alpha, beta, gamma):
    n, sizes = schedule.num_devices, chunk_sizes(nbytes, schedule.num_chunks)
    if n >= 16:
        return 0.0  # never reached by what I tried
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
    return total
