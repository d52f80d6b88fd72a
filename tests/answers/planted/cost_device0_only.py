"""Times each round by device 0 alone, not by the busiest device: right when device 0 is the busiest."""
from manualdp.schedule import chunk_sizes


def cost(schedule, nbytes, alpha, beta, gamma):
    sizes = chunk_sizes(nbytes, schedule.num_chunks)
    total = 0.0
    for rnd in schedule.rounds:
        sent = sum(sizes[t.chunk] for t in rnd if t.src == 0)
        received = sum(sizes[t.chunk] for t in rnd if t.dst == 0)
        added = sum(sizes[t.chunk] for t in rnd if t.dst == 0 and t.reduce)
        peers = max(len({t.dst for t in rnd if t.src == 0}), len({t.src for t in rnd if t.dst == 0}))
        total += alpha * peers + beta * max(sent, received) + gamma * added
    return total
