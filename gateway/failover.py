"""Keeps one client request going while nodes fail: retries before its first token, resumption after.

Lifecycle of one request (`ClusterBackend.generate` runs the attempts, this module decides):
  1. `next_attempt` says what to ask the nodes for: the first attempt is the client's request;
  2. every chunk passes through `record` on its way to the client: its tokens count as sent;
  3. a node call fails (`NodeCallError` names the node whose call it was): that node is left out
     of this request's later attempts (unless none of its role would be left), and `after_failure`
       - retries on other nodes when this attempt sent nothing, at most `max_attempts` attempts
         in a row that send nothing;
       - resumes elsewhere (a migration) when it sent tokens, at most `max_migrations` times:
         the prompt plus the tokens already sent become the new prompt (the prefix cache and the
         KV index make it cheap), `max_tokens` shrinks by them and `num_prior_output_tokens`
         tells the nodes which output position sampling continues from. The client's stream
         goes on from the next token: no gap, no duplicate;
       - otherwise raises the failure as a BackendError.
Every attempt has its own request id on the nodes (`<id>.<n>` after the first), so a node that
still tears down an earlier attempt never confuses it with the next.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from prometheus_client import Counter

from gateway.backend import BackendError, BackendErrorKind, GenerationChunk
from pdserve.cluster_state.registry import NodeInfo
from pdserve.engine.sampling_params import SamplingParams

RETRIES = Counter(
    "pdserve_gateway_retries", "Attempts started again on other nodes before any token was sent", ["node_id"]
)
MIGRATIONS = Counter("pdserve_gateway_migrations", "Streams resumed on other nodes after tokens were sent", ["node_id"])

# Another node would answer these the same way: the request (or the cluster's set-up) is at fault.
NOT_RETRYABLE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNIMPLEMENTED,
}
STATUS_TO_KIND = {
    grpc.StatusCode.INVALID_ARGUMENT: BackendErrorKind.INVALID_REQUEST,
    grpc.StatusCode.OUT_OF_RANGE: BackendErrorKind.INVALID_REQUEST,
    grpc.StatusCode.RESOURCE_EXHAUSTED: BackendErrorKind.OVERLOADED,
}


class NodeCallError(Exception):
    """A call to one node failed: `node` is the node whose call it was, `code` and `details` what
    gRPC said (a stream that ended without its last chunk is UNAVAILABLE)."""

    def __init__(self, node: NodeInfo, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{node.role} node {node.node_id}: {code.name.lower()}: {details}")
        self.node = node
        self.code = code

    @property
    def retryable(self) -> bool:
        return self.code not in NOT_RETRYABLE

    def to_backend_error(self) -> BackendError:
        return BackendError(STATUS_TO_KIND.get(self.code, BackendErrorKind.UNAVAILABLE), str(self))


@contextlib.contextmanager
def calling(node: NodeInfo) -> Iterator[None]:
    """Names the node in what a call to it raises (the router then avoids only that node)."""
    try:
        yield
    except grpc.aio.AioRpcError as error:
        raise NodeCallError(node, error.code(), error.details() or "") from error


@dataclass(frozen=True)
class FailoverPolicy:
    """How hard the gateway tries: attempts in a row that send nothing, and stream migrations."""

    max_attempts: int = 3
    max_migrations: int = 2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be 0 (no failover) or more, got {self.max_migrations}")


@dataclass(frozen=True)
class Attempt:
    """What one attempt asks the nodes for."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class ResumableRequest:
    """One client request across its attempts. Mutates only its own record: the tokens sent,
    the nodes that failed it, and its attempt and migration counts."""

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, policy: FailoverPolicy
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.policy = policy
        self.sent_token_ids: list[int] = []
        self.failed_node_ids: set[str] = set()
        self.num_attempts = 0
        self.num_failed_in_a_row = 0  # attempts since the last token sent
        self.num_migrations = 0
        self.last_failure: NodeCallError | None = None
        self._sent_in_attempt = False
        self._first_in_attempt = True

    @property
    def num_tokens_left(self) -> int:
        return self.params.max_tokens - len(self.sent_token_ids)

    def next_attempt(self) -> Attempt:
        """The client's request, or after tokens were sent, its continuation from the next one."""
        suffix = f".{self.num_attempts}" if self.num_attempts else ""
        self.num_attempts += 1
        self._sent_in_attempt, self._first_in_attempt = False, True
        if not self.sent_token_ids:
            return Attempt(self.request_id + suffix, self.prompt_token_ids, self.params)
        params = dataclasses.replace(
            self.params,
            max_tokens=self.num_tokens_left,
            num_prior_output_tokens=self.params.num_prior_output_tokens + len(self.sent_token_ids),
        )
        return Attempt(self.request_id + suffix, self.prompt_token_ids + self.sent_token_ids, params)

    def record(self, chunk: GenerationChunk) -> GenerationChunk:
        """Counts the chunk's tokens as sent. A resumed attempt's first chunk says how often the
        stream moved; its cached tokens are those of the longer prompt, not the client's, so
        they are dropped (usage keeps the first attempt's)."""
        if self.num_migrations:
            chunk.num_cached_tokens = 0
            if self._first_in_attempt and chunk.route is not None:
                chunk.route += f"; migrations={self.num_migrations}"
        self._first_in_attempt = False
        if chunk.token_ids:
            self.sent_token_ids += chunk.token_ids
            self._sent_in_attempt, self.num_failed_in_a_row = True, 0
        return chunk

    def after_failure(self, failure: NodeCallError) -> None:
        """Leaves the failed node out of later attempts if another attempt may run; raises the
        failure as a BackendError if not."""
        self.last_failure = failure
        if not failure.retryable:
            raise failure.to_backend_error() from failure
        self.failed_node_ids.add(failure.node.node_id)  # the other node of the route stays eligible
        if self._sent_in_attempt:
            if self.num_migrations >= self.policy.max_migrations:
                raise failure.to_backend_error() from failure
            self.num_migrations += 1
            MIGRATIONS.labels(failure.node.node_id).inc()
            return
        self.num_failed_in_a_row += 1
        if self.num_failed_in_a_row >= self.policy.max_attempts:
            raise failure.to_backend_error() from failure
        RETRIES.labels(failure.node.node_id).inc()

    def no_route_error(self) -> BackendError:
        """What to raise when no nodes are left to try: the last failure, if there was one."""
        if self.last_failure is not None:
            return self.last_failure.to_backend_error()
        return BackendError(BackendErrorKind.UNAVAILABLE, "no healthy prefill and decode nodes are registered")
