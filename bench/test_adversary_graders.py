"""Issue 32: the new graders (`manualdp check cost|hook|zero1|checkpoint|diloco`) tried as a student would, off the
happy path, by someone who did not write them (../shared/ADVERSARY.md's classes).

Each answer is graded by `python -m manualdp check EXERCISE FILE` in a session of its own (killed after a bound, so
that a hang is seen and never left), its TMPDIR under the test's folder, so that a process or a folder left behind
is found. The bar: a wrong answer FAILs (exit status 1) with one paragraph naming what is wrong; a right answer,
however different from the reference, PASSes (exit status 0); nothing takes longer than its bound, no Traceback,
no process and nothing but torch's own cache left in TMPDIR. A case where the grader falls short of the bar is
marked xfail(strict=True) with what it does instead (`GRADER_BUGS`).

Not repeated here: tests/answers/ (graded by bench/test_check_answers.py) and round 32's grader cases
(bench/test_adversary_round32.py); nor an answer that kills or stops the grader, which another change isolates.
"""
import concurrent.futures
import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time
from string import Template

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "book" / "solutions"
TOTAL = 90  # --total: seconds for the whole check
BOUND = TOTAL + 60  # seconds a grading may take here: two interpreters starting on a busy 2-core machine on top


# ---------------------------------------------------------------------------------------------------------------
# cost(schedule, nbytes, alpha, beta, gamma): the reference with one slip at a time

COST = Template('''
$imports
from manualdp.schedule import chunk_sizes


def cost(schedule, nbytes, alpha, beta, gamma):
    $pre
    n, sizes = schedule.num_devices, $sizes
    total = 0.0
    for r, rnd in enumerate(schedule.rounds):
        sent, received, added = [0] * n, [0] * n, [0] * n
        peers_out, peers_in = [set() for _ in range(n)], [set() for _ in range(n)]
        for t in rnd:
            sent[t.src] += sizes[t.chunk]
            received[t.dst] += sizes[t.chunk]
            if $reduce:
                added[t.dst] += sizes[t.chunk]
            peers_out[t.src].add(t.dst)
            peers_in[t.dst].add(t.src)
        times = [alpha * $messages + beta * $moved + gamma * added[d] for d in range(n)]
        $post
        total += $combine
    $ret
''')
COST_RIGHT = dict(imports="", pre="pass", sizes="chunk_sizes(nbytes, schedule.num_chunks)", reduce="t.reduce",
                  messages="max(len(peers_out[d]), len(peers_in[d]))", moved="max(sent[d], received[d])",
                  post="pass", combine="max(times, default=0.0)", ret="return total")


def cost(**slip) -> str:
    return COST.substitute({**COST_RIGHT, **slip})


# ---------------------------------------------------------------------------------------------------------------
# fp16_compress_hook(process_group, bucket): the reference with one slip at a time

HOOK = Template('''
import os
import torch
import torch.distributed as dist


def fp16_compress_hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    $pre
    small = $compress
    future = dist.all_reduce(small, group=group, async_op=True).get_future()

    def decompress(fut):
        return $decompress

    $ret
''')
HOOK_RIGHT = dict(pre="pass", compress="buffer.to(torch.float16).div_(group.size())",
                  decompress="buffer.copy_(fut.value()[0])", ret="return future.then(decompress)")


def hook(**slip) -> str:
    return HOOK.substitute({**HOOK_RIGHT, **slip})


# ---------------------------------------------------------------------------------------------------------------
# zero1_step(params, grads, momenta, lr, momentum)

ZERO1 = Template('''
import os
import sys
import tempfile
import time
import torch
from manualdp.collectives import all_gather, chunk, reduce_scatter


def zero1_step(params, grads, momenta, lr, momentum):
    n = len(params)
    $pre
    summed = reduce_scatter(grads)
    for i in range(n):
        $update
    $gather
''')
ZERO1_RIGHT = dict(pre="pass", update="momenta[i].mul_(momentum).add_(summed[i])\n"
                                      "        chunk(params[i], i, n).add_(momenta[i], alpha=-lr)",
                   gather="all_gather(params)")


def zero1(**slip) -> str:
    return ZERO1.substitute({**ZERO1_RIGHT, **slip})


# ---------------------------------------------------------------------------------------------------------------
# outer_step(theta, replicas, momentum, lr, mu)

DILOCO = Template('''
import sys
import torch


def outer_step(theta, replicas, momentum, lr, mu):
    $pre
    delta = $delta
    new_momentum = $momentum
    return $ret
$tail''')
DILOCO_RIGHT = dict(pre="pass", delta="sum(theta - t for t in replicas) / len(replicas)",
                    momentum="mu * momentum + delta", ret="theta - lr * (delta + mu * new_momentum), new_momentum",
                    tail="")


def diloco(**slip) -> str:
    return DILOCO.substitute({**DILOCO_RIGHT, **slip})


# ---------------------------------------------------------------------------------------------------------------
# save_checkpoint(path, model, optimizer, step), load_checkpoint(path, model, optimizer)

CHECKPOINT = Template('''
import os
import shutil
import sys
import tempfile
import threading
import torch

$extra


def save_checkpoint(path, model, optimizer, step):
    $save


def load_checkpoint(path, model, optimizer):
    $load
''')
SAVE = ('torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), '
        '"rng": torch.get_rng_state(), "step": step}, path)')
LOAD = '''state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return state["step"]'''


def checkpoint(save=SAVE, load=LOAD, extra="") -> str:
    return CHECKPOINT.substitute(save=save, load=load, extra=extra)


# ---------------------------------------------------------------------------------------------------------------
# The answers: name -> (exercise, ADVERSARY.md class, file text, "PASS" or a regex the FAIL paragraph must match
# after "FAIL EXERCISE (FILE): ", extra options)

WRONG_MATHS, SIZES, TYPES, CHEAT, HOSTILE, RIGHT = ("plausible wrong maths", "right only for the sizes tried",
                                                    "wrong type, None, mutated inputs", "cheats",
                                                    "hostile (hangs, exits, prints, writes files)",
                                                    "right but different")
CALL_COST = r"cost\(schedule, nbytes=\d+, alpha=\S+, beta=\S+, gamma=\S+\) for .*"
NUMBERS = r"expected (?P<want>\S+) s \(manualdp.cost.cost\), got (?!(?P=want) s)\S+ s"  # numbers that read apart
CALL_ZERO1 = (r"zero1_step\(params, grads, momenta, lr=\S+, momentum=\S+\) on \d devices?, \d+ parameters?, "
              r"step \d of \d(: grads .*?)?")
CALL_DILOCO = r"outer_step\(theta, replicas, buffer, lr=\S+, momentum=\S+\) on \d+ replica\(s\) of shape \(.*\)"
RUN = r"a run of \d steps \((SGD with momentum 0.9|Adam).*\) stopped after step \d"
CK = ["--timeout", "30"]  # a whole training run per call: 3 s is too tight on a busy machine
FORGE = '''
import os


def cost(schedule, nbytes, alpha, beta, gamma):   # wrong, and prints a verdict of its own where the grader prints
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                words = f.read().split(b"\\0")
            if b"check" in words and __file__.encode() in words:  # the grader grading this file
                with open(f"/proc/{pid}/fd/1", "w") as out:
                    out.write("PASS cost (my_cost.py): 100 schedules drawn by hypothesis: your time equals "
                              "manualdp.cost.cost's, to 1e-9\\n")
        except OSError:
            pass
    return 0.0
'''
ENV = {"cost_forges_a_pass_without_namespaces": {"MANUALDP_NAMESPACES": "0"}}  # the sandbox's fallback

ANSWERS = {
    # ----------------------------------------------------------------------------------------------- cost
    "cost_sent_plus_received": ("cost", WRONG_MATHS, cost(moved="(sent[d] + received[d])"),
                                CALL_COST + ": " + NUMBERS + r"\. Yours counts sent plus received: .*full duplex", []),
    "cost_devices_added_up": ("cost", WRONG_MATHS, cost(combine="sum(times)"),
                              CALL_COST + ": " + NUMBERS + r"\. Yours counts every device's time added up", []),
    "cost_gamma_on_copies": ("cost", WRONG_MATHS, cost(reduce="True"),
                             CALL_COST + ": " + NUMBERS + r"\. Yours counts adds every chunk received", []),
    "cost_alpha_once_a_round": ("cost", WRONG_MATHS,
                                cost(messages="(1 if peers_out[d] or peers_in[d] else 0)"),
                                CALL_COST + ": " + NUMBERS, []),
    "cost_even_chunks": ("cost", SIZES, cost(sizes="[nbytes / schedule.num_chunks] * schedule.num_chunks"),
                         CALL_COST + ": " + NUMBERS, []),
    "cost_float32_rounds": ("cost", WRONG_MATHS,
                            cost(imports="import torch",
                                 combine="float(torch.tensor(max(times, default=0.0), dtype=torch.float32))"),
                            CALL_COST + ": " + NUMBERS, []),
    "cost_busy_devices_only": ("cost", SIZES,  # max() over the devices that appear: a round with none raises
                               cost(combine="max(times[d] for d in {t.src for t in rnd} | {t.dst for t in rnd})"),
                               CALL_COST + r" raised ValueError: max\(\) .*empty", []),
    "cost_forgets_return": ("cost", TYPES, cost(ret="total"),
                            CALL_COST + r": expected a number of seconds, got None", []),
    "cost_numpy_float": ("cost", RIGHT, cost(imports="import numpy as np", ret="return np.float64(total)"),
                         "PASS", []),
    "cost_debug_print": ("cost", RIGHT, cost(post="print('round', r, times)"), "PASS", []),
    "cost_the_librarys_own": ("cost", CHEAT, "from manualdp.cost import cost  # the very function it is graded "
                                             "against\n",
                              r"the file's cost is not written in it but taken from manualdp\.cost: write it yourself",
                              []),
    "cost_loops_at_16_devices": ("cost", HOSTILE, cost(pre="while schedule.num_devices >= 16:\n        pass"),
                                 CALL_COST + r" did not return within the 3 s it may take", []),
    "cost_forges_a_pass": ("cost", HOSTILE, FORGE, CALL_COST + ": " + NUMBERS, []),
    "cost_forges_a_pass_without_namespaces": ("cost", HOSTILE, FORGE, CALL_COST + ": " + NUMBERS, []),
    # ----------------------------------------------------------------------------------------------- hook
    "hook_sum_no_divide": ("hook", WRONG_MATHS, hook(compress="buffer.to(torch.float16)"),
                           r"fp16_compress_hook on 2 ranks, step 0, rank \d: .* Yours is 2 times torch's", []),
    "hook_divides_twice": ("hook", WRONG_MATHS,
                           hook(decompress="buffer.copy_(fut.value()[0]).div_(group.size())"),
                           r"fp16_compress_hook on 2 ranks, step 0, rank \d: the gradients when backward returned "
                           r"differ from those with torch's fp16_compress_hook: \S+, element \d+, is \S+ where "
                           r"torch's is \S+", []),
    "hook_bfloat16": ("hook", WRONG_MATHS, hook(compress="buffer.to(torch.bfloat16).div_(group.size())"),
                      r"fp16_compress_hook on 2 ranks, step 0, rank \d: .*differ from those with torch's", []),
    "hook_only_rank0_divides": ("hook", WRONG_MATHS,
                                hook(compress="buffer.to(torch.float16).div_(group.size() if dist.get_rank() == 0 "
                                              "else 1)"),
                                r"fp16_compress_hook on 2 ranks, step 0, rank \d: .*differ from those with torch's",
                                []),
    "hook_divides_by_two": ("hook", SIZES, hook(compress="buffer.to(torch.float16).div_(2)  # 2 ranks, as I tried"),
                            r"fp16_compress_hook on 3 ranks, step 0, rank \d: .* Yours is 3/2 times torch's: divide "
                            r"by the world size \(3 here", []),
    "hook_process_group_is_none": ("hook", TYPES, hook(compress="buffer.to(torch.float16).div_(process_group.size())"),
                                   r"rank \d: AttributeError: 'NoneType' object has no attribute 'size' \(at .*, "
                                   r"line \d+", []),
    "hook_returns_none": ("hook", TYPES, hook(ret="return None"),
                          r".*\b(returned None|a Future|future)\b", []),
    "hook_no_decompress": ("hook", TYPES, hook(ret="return future  # the float16 sum, as it came"),
                           r"rank \d: .*(\.then|float32|decompress)", []),
    "hook_future_never_set": ("hook", HOSTILE, hook(ret="return torch.futures.Future()"),
                              r"(was still running when the whole check ran out of time|the 2 ranks did not "
                              r"finish)", []),
    "hook_rank1_exits": ("hook", HOSTILE, hook(pre="if dist.get_rank() == 1:\n        os._exit(3)"),
                         r"a rank died: process 1 terminated with exit code 3", []),
    "hook_divides_in_float32_first": ("hook", RIGHT, hook(compress="buffer.div(group.size()).to(torch.float16)"),
                                      "PASS", []),
    "hook_all_gather_blocking": ("hook", RIGHT, '''
import torch
import torch.distributed as dist


def fp16_compress_hook(process_group, bucket):   # gathers every rank's float16 share and adds them, then a done future
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    share = buffer.to(torch.float16).div_(group.size())
    shares = [torch.empty_like(share) for _ in range(group.size())]
    dist.all_gather(shares, share, group=group)
    total = shares[0].clone()
    for s in shares[1:]:
        total += s
    done = torch.futures.Future()
    done.set_result(buffer.copy_(total))
    return done
''', "PASS", []),
    "hook_reference": ("hook", RIGHT, SOLUTIONS / "hook.py", "PASS", []),
    # ----------------------------------------------------------------------------------------------- zero1
    "zero1_owns_chunk_i": ("zero1", WRONG_MATHS, zero1(
        update="lo, hi = chunk_bounds(params[i].numel(), n)[i]  # device i owns chunk i? it owns (i + 1) % n\n"
               "        momenta[i].mul_(momentum).add_(summed[i])\n"
               "        params[i][lo:hi].add_(momenta[i], alpha=-lr)").replace(
        "import os", "from manualdp.schedule import chunk_bounds\nimport os"), CALL_ZERO1, []),
    "zero1_dampening": ("zero1", WRONG_MATHS, zero1(
        update="momenta[i].mul_(momentum).add_(summed[i], alpha=1 - momentum)\n"
               "        chunk(params[i], i, n).add_(momenta[i], alpha=-lr)"),
        CALL_ZERO1 + r": expected device \d's momentum buffer", []),
    "zero1_steps_with_old_buffer": ("zero1", WRONG_MATHS, zero1(
        update="chunk(params[i], i, n).add_(momenta[i], alpha=-lr)\n"
               "        momenta[i].mul_(momentum).add_(summed[i])"),
        CALL_ZERO1 + r": expected every device's parameters", []),
    "zero1_gathers_from_device_0": ("zero1", WRONG_MATHS,
                                    zero1(gather="for p in params[1:]:\n        p.copy_(params[0])"),
                                    CALL_ZERO1 + r": expected every device's parameters", []),
    "zero1_float32_buffer": ("zero1", WRONG_MATHS, zero1(
        update="momenta[i].copy_((momentum * momenta[i].float() + summed[i].float()).double())\n"
               "        chunk(params[i], i, n).add_(momenta[i], alpha=-lr)"),
        CALL_ZERO1 + r".*: expected device \d's momentum buffer, .*, to be (?P<want>\[[^\]]*\]), got "
                     r"(?!(?P=want))", []),
    "zero1_torch_chunk": ("zero1", SIZES, '''
import torch


def zero1_step(params, grads, momenta, lr, momentum):   # torch.chunk: right when the numel divides, as I tried
    n = len(params)
    total = torch.stack(grads).sum(0)
    for i in range(n):
        own = (i + 1) % n
        momenta[i].mul_(momentum).add_(torch.chunk(total, n)[own])
        torch.chunk(params[i], n)[own].add_(momenta[i], alpha=-lr)
    for i in range(n):
        for j in range(n):
            torch.chunk(params[i], n)[(j + 1) % n].copy_(torch.chunk(params[j], n)[(j + 1) % n])
''', CALL_ZERO1, []),
    "zero1_rebinds_params": ("zero1", TYPES, zero1(
        update="momenta[i].mul_(momentum).add_(summed[i])\n"
               "        p = params[i].clone()\n"
               "        chunk(p, i, n).add_(momenta[i], alpha=-lr)\n"
               "        params[i] = p"),
        CALL_ZERO1 + r": your zero1_step put a new tensor into params or momenta", []),
    "zero1_returns_new_lists": ("zero1", TYPES, '''
from manualdp.collectives import all_gather, chunk, reduce_scatter


def zero1_step(params, grads, momenta, lr, momentum):   # returns the new state instead of writing it in place
    n = len(params)
    summed = reduce_scatter(grads)
    new_momenta = [momentum * momenta[i] + summed[i] for i in range(n)]
    new_params = [p.clone() for p in params]
    for i in range(n):
        chunk(new_params[i], i, n).add_(new_momenta[i], alpha=-lr)
    all_gather(new_params)
    return new_params, new_momenta
''', CALL_ZERO1 + r".*(in place|returned|returns)", []),
    "zero1_cached_full_buffer": ("zero1", CHEAT, '''
import torch
from manualdp.collectives import chunk

_full = {}   # the whole momentum buffer, kept here across calls, keyed by the sizes


def zero1_step(params, grads, momenta, lr, momentum):
    n, numel = len(params), params[0].numel()
    buf = _full.setdefault((n, numel), torch.zeros(numel, dtype=torch.float64))
    buf.mul_(momentum).add_(torch.stack(grads).sum(0))
    for i in range(n):
        params[i].add_(buf, alpha=-lr)
        momenta[i].copy_(chunk(buf, i, n))
''', CALL_ZERO1, []),
    "zero1_sleeps_in_c": ("zero1", HOSTILE, zero1(pre="if n >= 3:\n        time.sleep(3600)"),
                          CALL_ZERO1 + r" did not return within the 3 s it may take", []),
    "zero1_exits_on_empty": ("zero1", HOSTILE, zero1(pre="if params[0].numel() == 0:\n        sys.exit('nothing')"),
                             CALL_ZERO1 + r" raised SystemExit: nothing .* must return, not exit", []),
    "zero1_mkdtemp_per_call": ("zero1", HOSTILE, zero1(
        gather="all_gather(params)\n"
               "    torch.save(params, os.path.join(tempfile.mkdtemp(prefix='zero1-debug-'), 'params.pt'))"),
        "PASS", []),
    "zero1_by_hand": ("zero1", RIGHT, '''
from manualdp.schedule import chunk_bounds, owned_chunk


def zero1_step(params, grads, momenta, lr, momentum):   # no collectives: each chunk summed, stepped, copied by hand
    n = len(params)
    bounds = chunk_bounds(params[0].numel(), n)
    for i in range(n):
        lo, hi = bounds[owned_chunk(i, n)]
        g = grads[0][lo:hi].clone()
        for j in range(1, n):
            g += grads[j][lo:hi]
        momenta[i].mul_(momentum).add_(g)
        params[i][lo:hi] -= lr * momenta[i]
    for i in range(n):
        lo, hi = bounds[owned_chunk(i, n)]
        for j in range(n):
            if j != i:
                params[j][lo:hi] = params[i][lo:hi]
''', "PASS", []),
    # ----------------------------------------------------------------------------------------------- diloco
    "diloco_sign_flipped": ("diloco", WRONG_MATHS, diloco(delta="sum(t - theta for t in replicas) / len(replicas)"),
                            CALL_DILOCO + r".*: expected new theta", []),
    "diloco_plain_momentum": ("diloco", WRONG_MATHS, diloco(ret="theta - lr * new_momentum, new_momentum"),
                              CALL_DILOCO + r".*: expected new theta", []),
    "diloco_nesterov_on_old_buffer": ("diloco", WRONG_MATHS,
                                      diloco(ret="theta - lr * (delta + mu * momentum), new_momentum"),
                                      CALL_DILOCO + r".*: expected new theta", []),
    "diloco_mean_of_everything": ("diloco", WRONG_MATHS, diloco(delta="(theta - torch.stack(replicas)).mean()"),
                                  CALL_DILOCO + r".*: expected new theta", []),
    "diloco_two_replicas": ("diloco", SIZES,
                            diloco(delta="((theta - replicas[0]) + (theta - replicas[1])) / 2  # as I tried"),
                            CALL_DILOCO + r".*: (it raised IndexError|expected new theta)", []),
    "diloco_rows_only": ("diloco", SIZES, diloco(delta="torch.stack([(theta - t).reshape(theta.shape[0], -1) for t in "
                                                       "replicas]).mean(0).reshape(theta.shape)"),
                         CALL_DILOCO + r".*: it raised IndexError", []),
    "diloco_swapped_return": ("diloco", TYPES, diloco(ret="new_momentum, theta - lr * (delta + mu * new_momentum)"),
                              CALL_DILOCO + r".*: expected new theta", []),
    "diloco_returns_dict": ("diloco", TYPES,
                            diloco(ret="{'theta': theta - lr * (delta + mu * new_momentum), 'momentum': new_momentum}"),
                            CALL_DILOCO + r".*: expected a pair of tensors \(new theta, new buffer\), got", []),
    "diloco_changes_the_replicas": ("diloco", TYPES, diloco(
        pre="for t in replicas:\n        t.sub_(theta).neg_()  # each replica's change, in place",
        delta="sum(replicas) / len(replicas)"), CALL_DILOCO + r".*: it changed the replicas' parameters", []),
    "diloco_in_place_as_torch": ("diloco", RIGHT, diloco(
        momentum="momentum.mul_(mu).add_(delta)",
        ret="theta.sub_(lr * (delta + mu * new_momentum)), new_momentum"), "PASS", []),
    "diloco_the_graders_own": ("diloco", CHEAT,
                               "from manualdp.runners.grader.properties.diloco import expected_outer_step as "
                               "outer_step  # the grader's own formula\n",
                               r"the file's outer_step is not written in it but taken from "
                               r"manualdp\.runners\.grader\.properties\.diloco",
                               []),
    "diloco_loops_on_three": ("diloco", HOSTILE, diloco(pre="while len(replicas) >= 3:\n        pass"),
                              CALL_DILOCO + r".* did not return within the 3 s it may take", []),
    "diloco_keyboard_interrupt": ("diloco", HOSTILE,
                                  diloco(pre="if mu > 0.5:\n        raise KeyboardInterrupt"),
                                  CALL_DILOCO + r".*: it raised KeyboardInterrupt", []),
    "diloco_selftest_exits": ("diloco", HOSTILE, diloco(tail='''

print(outer_step(torch.zeros(2), [torch.ones(2)], torch.zeros(2), 0.7, 0.9))
sys.exit(0)
'''), r"importing the file raised SystemExit: 0 \(at .*, line \d+\)\. Is there a self-test", []),
    # ----------------------------------------------------------------------------------------------- checkpoint
    "checkpoint_restarts_the_count": ("checkpoint", WRONG_MATHS, checkpoint(load=LOAD.replace('return state["step"]',
                                                                                              "return 0")),
                                      RUN + r".*: load_checkpoint returned 0, expected [1-7]", CK),
    "checkpoint_returns_the_next_step": ("checkpoint", WRONG_MATHS,
                                         checkpoint(load=LOAD.replace('return state["step"]',
                                                                      'return state["step"] + 1')),
                                         RUN + r".*: load_checkpoint returned \d, expected \d", CK),
    "checkpoint_reseeds_instead_of_rng": ("checkpoint", WRONG_MATHS,
                                          checkpoint(load=LOAD.replace('torch.set_rng_state(state["rng"])',
                                                                       'torch.manual_seed(state["step"])')),
                                          RUN + r".*: the parameters differ from the uninterrupted run's", CK),
    "checkpoint_rebinds_the_optimizer": ("checkpoint", TYPES, checkpoint(load=LOAD.replace(
        'optimizer.load_state_dict(state["optimizer"])',
        'optimizer = type(optimizer)(model.parameters(), **optimizer.defaults)  # a fresh one, loaded\n'
        '    optimizer.load_state_dict(state["optimizer"])')),
        RUN + r".*: the parameters differ from the uninterrupted run's: .* Your resume equals one that restored "
              r"the model and torch's random number generator but not the optimizer's state", CK),
    "checkpoint_step_as_tensor": ("checkpoint", TYPES, checkpoint(save=SAVE.replace('"step": step',
                                                                                    '"step": torch.tensor(step)')),
                                  RUN + r".*: load_checkpoint returned .*(tensor|an int)", CK),
    "checkpoint_sgd_buffers_only": ("checkpoint", SIZES, checkpoint(
        save='buffers = [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]  # SGD, as I tried\n'
             '    torch.save({"model": model.state_dict(), "buffers": buffers, "rng": torch.get_rng_state(), '
             '"step": step}, path)',
        load='state = torch.load(path)\n'
             '    model.load_state_dict(state["model"])\n'
             '    for p, b in zip(model.parameters(), state["buffers"]):\n'
             '        optimizer.state[p]["momentum_buffer"] = b\n'
             '    torch.set_rng_state(state["rng"])\n'
             '    return state["step"]'),
        r"a run of \d steps \(Adam.*raised KeyError: 'momentum_buffer'", CK),
    "checkpoint_exclusive_create": ("checkpoint", SIZES, checkpoint(
        save='with open(path, "xb") as f:  # never overwrite a checkpoint\n'
             '        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), '
             '"rng": torch.get_rng_state(), "step": step}, f)'),
        RUN + r".* raised FileExistsError", CK),
    "checkpoint_appends": ("checkpoint", SIZES, checkpoint(
        save='with open(path, "ab") as f:\n'
             '        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), '
             '"rng": torch.get_rng_state(), "step": step}, f)'), RUN, CK),
    "checkpoint_ignores_path": ("checkpoint", HOSTILE, checkpoint(
        extra='MINE = os.path.join(tempfile.gettempdir(), "my_checkpoint.pt")  # one place for every checkpoint',
        save=SAVE.replace("}, path)", "}, MINE)"), load=LOAD.replace("torch.load(path,", "torch.load(MINE,")),
        RUN + r".*: save_checkpoint\('checkpoint\.pt', \.\.\.\) wrote nothing at 'checkpoint\.pt'", CK),
    "checkpoint_replays_from_the_seed": ("checkpoint", CHEAT, checkpoint(
        extra="from manualdp.runners.grader import jobs",
        save='torch.save({"step": step}, path)  # a step count is all a replay needs',
        load='step = torch.load(path)["step"]\n'
             '    seed = sys._getframe(1).f_locals["seed"]  # the grader\'s own run, read off its frame\n'
             '    torch.manual_seed(seed)\n'
             '    model.load_state_dict(jobs.Resumed().state_dict())\n'
             '    jobs._train(model, optimizer, 0, step)\n'
             '    return step'), RUN, CK),
    "checkpoint_waits_in_a_new_process": ("checkpoint", HOSTILE, checkpoint(
        extra="SAVED = []",
        save=SAVE + "\n    SAVED.append(step)",
        load="if not SAVED:\n        threading.Event().wait()  # waits for a save that, in a new process, never comes\n"
             "    " + LOAD), r"a run of 4 steps .* in a new process .* did not return within the 8 s",
        ["--timeout", "8"]),
    "checkpoint_read_only_backups": ("checkpoint", HOSTILE, checkpoint(save=SAVE + '''
    if os.path.isdir("backup"):
        os.chmod("backup", 0o755)
    os.makedirs("backup", exist_ok=True)
    shutil.copy(path, os.path.join("backup", f"step{step}.pt"))
    os.chmod("backup", 0o555)  # keep the backups safe'''), "PASS", CK),
    "checkpoint_whole_module": ("checkpoint", RIGHT, checkpoint(
        save=SAVE.replace('"model": model.state_dict()', '"model": model'),
        load=LOAD.replace("weights_only=True", "weights_only=False").replace(
            'model.load_state_dict(state["model"])', 'model.load_state_dict(state["model"].state_dict())')),
        "PASS", CK),
    "checkpoint_pickle": ("checkpoint", RIGHT, checkpoint(
        extra="import pickle",
        save='with open(path, "wb") as f:\n'
             '        pickle.dump({"model": model.state_dict(), "optimizer": optimizer.state_dict(), '
             '"rng": torch.get_rng_state(), "step": step}, f)',
        load=LOAD.replace("state = torch.load(path, weights_only=True)",
                          'with open(path, "rb") as f:\n        state = pickle.load(f)')), "PASS", CK),
}

VERDICT_BUGS = {  # answer -> what the grader says instead of an honest verdict in one clear paragraph
}
LEFTOVER_BUGS: dict = {}  # answer -> what the grader leaves behind


# ---------------------------------------------------------------------------------------------------------------
# Grading


def _ours(folder: str) -> list[int]:
    """Processes started under `folder`: their working folder lies under it, or their TMPDIR is its tmp/."""
    found, mark = [], f"TMPDIR={folder}/tmp".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(folder):
                found.append(int(pid))
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _left(folder: str, wait: float = 5.0) -> list[str]:
    """`_ours` that are still there after `wait` seconds (a process SIGKILLed a moment ago may still be exiting),
    each as 'pid state command'."""
    end = time.monotonic() + wait
    while (pids := _ours(folder)) and time.monotonic() < end:
        time.sleep(0.2)
    told = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except (OSError, IndexError):
            continue
        told.append(f"{pid} {state} {command}")
    return told


def _grade(name: str, root: pathlib.Path) -> dict:
    exercise, _, text, _, options = ANSWERS[name]
    work = root / name
    (work / "tmp").mkdir(parents=True)
    path = work / f"{name}.py"
    path.write_text(text.read_text() if isinstance(text, pathlib.Path) else textwrap.dedent(text))
    options = (options or ["--timeout", "3"]) + (["--examples", "10"] if exercise in ("hook", "checkpoint") else [])
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "manualdp", "check", exercise, str(path), *options, "--total",
                             str(TOTAL)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=work, start_new_session=True,
                            env=dict(os.environ, TMPDIR=str(work / "tmp"), PYTHONPATH=str(ROOT), **ENV.get(name, {})))
    try:
        out, err = proc.communicate(timeout=BOUND)
        hung = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        hung = True
    seconds = time.monotonic() - start
    left = _left(str(work))
    for pid in _ours(str(work)):  # our own leftovers, found by their folder or TMPDIR: end them, so that nothing
        with contextlib.suppress(OSError):  # outlives the test
            os.kill(pid, signal.SIGKILL)
    files = sorted(str(p.relative_to(work / "tmp")) for p in (work / "tmp").iterdir()
                   if not p.name.startswith("torchinductor_"))  # torch's own cache may stay
    for p in (work / "tmp").rglob("*"):  # let pytest remove what a hostile answer locked
        with contextlib.suppress(OSError):
            if p.is_dir() and not p.is_symlink():
                p.chmod(0o755)
    return {"rc": proc.returncode, "path": str(path), "raw": out, "out": " ".join(out.split()), "err": err[-3000:],
            "hung": hung,
            "seconds": round(seconds, 1), "left": left, "files": files}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("graders")
    slow_first = sorted(ANSWERS, key=lambda n: ANSWERS[n][0] not in ("hook", "checkpoint"))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        jobs = {name: pool.submit(_grade, name, root) for name in slow_first}
        return {name: job.result() for name, job in jobs.items()}


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_the_grader_gives_an_honest_verdict_in_one_paragraph_in_time(graded, name, request):
    if name in VERDICT_BUGS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=VERDICT_BUGS[name]))
    exercise, _, _, expected, _ = ANSWERS[name]
    got = graded[name]
    assert not got["hung"] and got["seconds"] < BOUND, got
    assert "Traceback" not in got["out"] + got["err"], got
    if expected == "PASS":
        assert got["rc"] == 0 and got["out"].startswith(f"PASS {exercise} "), got
        return
    label = f"FAIL {exercise} ({got['path']}): "
    assert got["rc"] == 1 and got["out"].startswith(label), got
    assert "\n\n" not in got["raw"].strip() and len(got["out"]) < 2000, got  # one paragraph
    assert re.match(expected, got["out"][len(label):]), got["out"]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_the_grader_leaves_no_process_and_nothing_in_tmpdir(graded, name, request):
    if name in LEFTOVER_BUGS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=LEFTOVER_BUGS[name]))
    got = graded[name]
    assert got["left"] == [] and got["files"] == [], got


def test_every_class_and_exercise_is_tried():
    counts: dict = {}
    for exercise, kind, *_ in ANSWERS.values():
        counts[exercise] = counts.get(exercise, 0) + 1
        counts[kind] = counts.get(kind, 0) + 1
    assert all(counts[e] >= 8 for e in ("cost", "hook", "zero1", "checkpoint", "diloco")), counts
    assert all(counts[k] >= 3 for k in (WRONG_MATHS, SIZES, TYPES, CHEAT, HOSTILE, RIGHT)), counts
