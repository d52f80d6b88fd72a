"""d2l's allreduce as the chapter writes it: `data[0][:] += ...` cannot slice a 0-dim tensor."""


def allreduce(data):
    for i in range(1, len(data)):
        data[0][:] += data[i].to(data[0].device)
    for i in range(1, len(data)):
        data[i][:] = data[0].to(data[i].device)
