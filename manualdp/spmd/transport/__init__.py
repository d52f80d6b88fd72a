"""How bytes move between ranks, and how ranks agree before they move.

- `peers.py`: waiting on another rank with a deadline; `PeerError` names who is silent;
- `plan.py`: a book schedule cut into this rank's messages, round by round;
- `p2p.py`: the executor: one rank runs its plan as `isend`/`irecv`;
- `group.py`: what is kept per process group (its ordered worker thread, link constants, scratch);
- `worker.py`: that worker: one daemon thread running calls in order (none at one rank);
- `call_check.py`: ranks that call a collective differently all raise: the data's tag is the call's
  fingerprint; headers beside the data from three ranks on;
- `late.py`: two ranks: a late first round makes them compare fingerprints through the store;
- `agree.py`: the one way ranks agree on anything (a digest, then the differing fields), and
  the one rank-0 broadcast every wrapper starts from;
- `postmortem.py`: which rank was lost first.
"""
