"""A pool: the replicas that serve one model, and what the router knows of each.

State only (no I/O): discovery calls `set_urls`, the scraper calls `observe`,
the proxy asks `plan` for an order of replicas and reports each attempt back.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pagefleet.engine.kv.hashing import block_hashes
from pagefleet.engine.protocol import ChatMessage
from pagefleet.engine.tokenization import encode_prompt, render_chat
from pagefleet.router.policy import Candidate, EjectionParams, Health, Policy, ScoringParams, rank
from pagefleet.router.prefix_index import PrefixIndex
from pagefleet.router.scrape import EngineSnapshot

logger = logging.getLogger(__name__)


@dataclass
class Replica:
    url: str
    index: PrefixIndex
    health: Health = field(default_factory=Health)
    in_flight: int = 0
    snapshot: EngineSnapshot | None = None  # None until a scrape found its engine up
    scrape_timeouts: int = 0  # consecutive

    def candidate(self, match: float) -> Candidate:
        s = self.snapshot
        assert s is not None
        return Candidate(self.url, self.in_flight, s.running, s.waiting, s.kv_usage, match)


@dataclass
class Plan:
    order: list[Replica]
    hashes: list[int]              # the prompt's full-block hashes (empty when not computed)
    matches: dict[str, float]      # prefix match fraction per replica URL

    def match_of(self, replica: Replica) -> float:
        return self.matches.get(replica.url, 0.0)


class Pool:
    def __init__(self, name: str, model: str, *, tokenizer: Any | None = None, policy: Policy = Policy.PREFIX,
                 scoring: ScoringParams | None = None, ejection: EjectionParams | None = None,
                 index_capacity: int = 1 << 17, session_capacity: int = 1 << 16) -> None:
        self.name, self.model, self.tokenizer, self.policy = name, model, tokenizer, policy
        self.scoring = scoring or ScoringParams()
        self.ejection = ejection or EjectionParams()
        self.index_capacity = index_capacity
        self.session_capacity = session_capacity
        self.replicas: dict[str, Replica] = {}
        self.block_size: int | None = None  # learned from the replicas' cache_config_info
        self._turn = 0
        self._sessions: OrderedDict[str, str] = OrderedDict()

    # ---- membership and observations ---------------------------------------------------------

    def set_urls(self, urls: Iterable[str]) -> tuple[set[str], set[str]]:
        """Replace the membership; replicas that stay keep their state. Returns (added, removed)."""
        new = {u.rstrip("/") for u in urls}
        added, removed = new - self.replicas.keys(), self.replicas.keys() - new
        for url in removed:
            del self.replicas[url]
        for url in sorted(added):
            self.replicas[url] = Replica(url, PrefixIndex(self.index_capacity))
        if added or removed:
            logger.info("pool %s: %d replicas (+%s -%s)", self.name, len(new), sorted(added), sorted(removed))
        return added, removed

    def observe(self, url: str, snapshot: EngineSnapshot | None) -> None:
        r = self.replicas.get(url)
        if r is None:
            return  # removed while the scrape was in flight
        r.snapshot = snapshot
        if snapshot is not None and snapshot.block_size:
            if self.block_size not in (None, snapshot.block_size):
                logger.warning("pool %s: replicas disagree on block size (%s vs %s); prefix scores use %s",
                               self.name, self.block_size, snapshot.block_size, snapshot.block_size)
            self.block_size = snapshot.block_size
            if snapshot.num_blocks:
                # Remember no more blocks than the replica can hold: beyond that the engine has
                # evicted them, and affinity to them would be a promise it cannot keep.
                r.index.resize(min(self.index_capacity, snapshot.num_blocks))

    def available(self, now: float) -> list[Replica]:
        return [r for r in self.replicas.values() if r.snapshot is not None and r.health.available(now)]

    def retry_after(self, now: float) -> int:
        """Seconds until a replica may be back (for 503 Retry-After)."""
        waits = [r.health.retry_after(now) for r in self.replicas.values() if r.snapshot is not None]
        return max(1, int(min(waits, default=1.0) + 0.999))

    # ---- decisions -------------------------------------------------------------------------------

    def needs_tokenizing(self, body: dict, chat: bool) -> bool:
        """Whether routing this request runs the tokenizer (the expensive part of a decision)."""
        return (self.policy is Policy.PREFIX and self.block_size is not None and self.tokenizer is not None
                and (chat or not isinstance(body.get("prompt"), list)))

    def routing_hashes(self, body: dict, chat: bool) -> list[int]:
        """Block hashes the engine will compute for this request's (first) prompt; empty
        when the router cannot predict them. Malformed input is not the router's to
        judge: the engine answers it with a proper error."""
        if self.block_size is None:
            return []
        try:
            if chat:
                messages = [ChatMessage.model_validate(m) for m in body["messages"]]
                text = render_chat(self.tokenizer, [{"role": m.role, "content": m.text()} for m in messages],
                                   bool(body.get("add_generation_prompt", True)))
                ids = encode_prompt(self.tokenizer, text, chat=True)
            else:
                prompt = body["prompt"]
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]  # a batch goes to one replica; its first prompt decides
                ids = encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
            salt = body.get("cache_salt")
            return block_hashes(ids, self.block_size, (self.model, None, salt if isinstance(salt, str) else None))
        except Exception:
            return []

    def plan(self, body: dict, chat: bool, session: str | None, now: float,
             hashes: list[int] | None = None) -> Plan:
        """The replicas to try, in order. `hashes` may be passed in when the caller
        already computed them (off the event loop, for big prompts)."""
        avail = self.available(now)
        if hashes is None:
            hashes = self.routing_hashes(body, chat) if self.policy is Policy.PREFIX and avail else []
        matches = {r.url: (r.index.match(hashes) / len(hashes) if hashes else 0.0) for r in avail}
        sticky = self._sessions.get(session) if session else None
        names = rank(self.policy, [r.candidate(matches[r.url]) for r in avail], self.scoring, turn=self._turn,
                     sticky=sticky)
        self._turn += 1
        return Plan([self.replicas[n] for n in names], hashes, matches)

    def routed(self, replica: Replica, plan: Plan, session: str | None) -> None:
        """The request goes to `replica`: remember what it will cache and who serves the session."""
        if plan.hashes:
            replica.index.add(plan.hashes)
        if session:
            self._sessions[session] = replica.url
            self._sessions.move_to_end(session)
            while len(self._sessions) > self.session_capacity:
                self._sessions.popitem(last=False)


def parse_pool_spec(text: str) -> tuple[str, str, list[str]]:
    """`NAME=MODEL:URL,URL...` (or `NAME=MODEL` when replicas are discovered) ->
    (name, model, urls). MODEL is what clients send as `model`; it may itself
    contain ':' since URLs are found by their scheme."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--pool {text!r}: expected NAME=MODEL:URL[,URL...] or NAME=MODEL")
    cut = min((i for i in (rest.find(":http://"), rest.find(":https://")) if i >= 0), default=-1)
    model, urls = (rest, []) if cut < 0 else (rest[:cut], [u for u in rest[cut + 1:].split(",") if u])
    if not model:
        raise ValueError(f"--pool {text!r}: MODEL is empty")
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"--pool {text!r}: {u!r} is not an http(s) URL")
    return name, model, urls
