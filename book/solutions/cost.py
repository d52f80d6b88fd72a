"""Exercise 3.1, a reference solution.  Check it: manualdp check cost book/solutions/cost.py"""
from manualdp.schedule import chunk_sizes


def cost(schedule, nbytes, alpha, beta, gamma):
    """The alpha-beta-gamma time of `schedule` for a buffer of `nbytes` bytes: each round lasts as long as its
    busiest device."""
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
            peers_out[t.src].add(t.dst)  # every chunk to one peer in a round: one message
            peers_in[t.dst].add(t.src)
        total += max((alpha * max(len(peers_out[d]), len(peers_in[d]))  # full duplex: sends and receives at once
                      + beta * max(sent[d], received[d]) + gamma * added[d] for d in range(n)), default=0.0)
    return total
