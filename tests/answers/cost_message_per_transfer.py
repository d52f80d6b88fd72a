"""A careless answer to exercise 3.1: one alpha per transfer, where the chunks sent to one peer in a round are one
message."""
from manualdp.schedule import chunk_sizes


def cost(schedule, nbytes, alpha, beta, gamma):
    n, sizes = schedule.num_devices, chunk_sizes(nbytes, schedule.num_chunks)
    total = 0.0
    for rnd in schedule.rounds:
        sent, received, added, out, into = [0] * n, [0] * n, [0] * n, [0] * n, [0] * n
        for t in rnd:
            sent[t.src] += sizes[t.chunk]
            received[t.dst] += sizes[t.chunk]
            added[t.dst] += sizes[t.chunk] if t.reduce else 0
            out[t.src] += 1
            into[t.dst] += 1
        total += max((alpha * max(out[d], into[d]) + beta * max(sent[d], received[d]) + gamma * added[d]
                      for d in range(n)), default=0.0)
    return total
