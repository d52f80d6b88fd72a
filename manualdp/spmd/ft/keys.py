"""The keys of the coordinator's store, in one place: every file of the room names what it writes and reads here.

All of them live below `PREFIX` (`coordinator.connect` opens the store so), beside whatever
else uses the same store. Who writes each:

- `heartbeat.py`: `replicas` (every id that registered, one a line) and `heartbeat/ID` ("NONCE COUNTER");
- `quorum.py`: `round/R/asks` (the askers, one JSON a line), `round/R/quorum` (the first proposal
  written), `latest` (a hint: the rounds up to it are decided), `held/ID` (the agreed state a
  replica holds: "STEP SINCE", or "" for none);
- `commit.py`: `round/R/vote/ID` ("1" or "0") and `round/R/outcome` ("commit" or "discard");
- `recovery.py`: `state/R/SOURCE` (the state's `torch.save` bytes) and `state/R/SOURCE/sha256`;
- `quorum_group.py`: `group/N`, below which gloo's rendezvous of the quorum's group N meets;
- `group_lanes.py`: `group/N/lane/I`, where rank I of each replica group of quorum group N meets (lane I);
- `admission.py`: `settings/ID` (a replica's settings, JSON), `settings` (the run's: its first quorum's) and
  `refused` (one line per joiner refused, that the running replicas log);
- `durable.py`: `committed` (the run's highest committed step count that a replica holds, never lowered) and
  `finished` (the step count at which the run ended);
- `bar.py`: `barred` (one JSON a line: a removed member's id, the nonce of its process, why), by the members
  whose guard removed it;
- `coordinator.py`: `mode` ("signed" or "open": for a replica's one-line error only) and, with a secret,
  `hello` (this coordinator's life: a random nonce, signed with the bare secret, that keys every other
  signature; a replica with another secret finds that it does not verify).

With a secret every name is signed too (`signed_store.py`): the store holds HMAC(secret, name).
"""
from __future__ import annotations

__all__ = ["PREFIX", "REPLICAS", "LATEST", "MODE", "HELLO", "heartbeat", "held", "asks", "quorum", "vote",
           "outcome", "state", "state_sha256", "group", "lane",
           "SETTINGS", "REFUSED", "settings_of", "COMMITTED", "FINISHED", "BARRED"]

PREFIX = "manualdp-ft"  # every key of the fault-tolerant room lives below it
REPLICAS = "replicas"
LATEST = "latest"
MODE = "mode"
HELLO = "hello"
SETTINGS = "settings"
REFUSED = "refused"
COMMITTED = "committed"
FINISHED = "finished"
BARRED = "barred"


def heartbeat(replica_id: str) -> str:
    return f"heartbeat/{replica_id}"


def held(replica_id: str) -> str:
    return f"held/{replica_id}"


def asks(round_: int) -> str:
    return f"round/{round_}/asks"


def quorum(round_: int) -> str:
    return f"round/{round_}/quorum"


def vote(round_: int, replica_id: str) -> str:
    return f"round/{round_}/vote/{replica_id}"


def outcome(round_: int) -> str:
    return f"round/{round_}/outcome"


def state(round_: int, source: str) -> str:
    return f"state/{round_}/{source}"


def state_sha256(round_: int, source: str) -> str:
    return state(round_, source) + "/sha256"


def group(number: int) -> str:
    return f"group/{number}"


def lane(number: int, index: int) -> str:
    return f"group/{number}/lane/{index}"



def settings_of(replica_id: str) -> str:
    return f"settings/{replica_id}"
