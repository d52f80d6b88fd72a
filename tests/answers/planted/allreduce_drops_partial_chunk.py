CHUNK = 1 << 20
def allreduce(tensors):
    flat = [t.view(-1) if t.is_contiguous() else None for t in tensors]
    n = tensors[0].numel()
    if n <= CHUNK or any(f is None for f in flat):
        for i in range(1, len(tensors)):
            tensors[0].add_(tensors[i])
        for i in range(1, len(tensors)):
            tensors[i].copy_(tensors[0])
        return
    for k in range(n // CHUNK):  # slip: the last partial chunk is never summed
        s = slice(k * CHUNK, (k + 1) * CHUNK)
        for i in range(1, len(flat)):
            flat[0][s].add_(flat[i][s])
        for i in range(1, len(flat)):
            flat[i][s].copy_(flat[0][s])
