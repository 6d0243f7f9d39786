"""A response the gateway stored for a model of kvgate's workers, as it is kept in memory
(gateway/response_store.py) and in Redis (gateway/shared_response_store.py)."""

import json
from dataclasses import dataclass

from gateway.response_ids import valid_id
from gateway.response_request import Message

MAX_TENANT_CHARS = 256
# What a held record costs beyond its blobs' bytes: the record, its two bytes objects and two
# strings, and the store's entry and its slots in the store's tables (CPython 3.11, 64-bit).
HELD_OVERHEAD = 512


def compact(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


@dataclass(frozen=True)
class StoredResponse:
    """A stored response: its id, the tenant whose key made it ("" without API keys), its
    model, the Response object as answered and its conversation: the chain's input items
    (never its instructions) and its own output message, which a follow-up's prompt starts
    with. The Response object and the conversation are each held as their JSON's bytes, decoded
    when used (`answer`, `messages`): as objects, a conversation took up to five times its
    JSON's bytes, which the store's byte bound counts (`held_bytes`)."""

    response_id: str
    tenant: str
    model: str
    response: bytes
    conversation: bytes

    @staticmethod
    def of(response_id: str, tenant: str, response: dict, conversation: tuple[Message, ...]) -> "StoredResponse":
        """The record of `response` (a Response object) and its `conversation`."""
        blob = compact([m.to_json() for m in conversation])
        return StoredResponse(response_id, tenant, response["model"], compact(response), blob)

    def answer(self) -> dict:
        """The Response object as answered."""
        return json.loads(self.response)

    def messages(self) -> tuple[Message, ...]:
        """The conversation a follow-up continues."""
        return tuple(Message.from_json(m) for m in json.loads(self.conversation))

    def held_bytes(self) -> int:
        """What holding the record costs: its blobs, its id and tenant, and HELD_OVERHEAD."""
        return len(self.response) + len(self.conversation) + len(self.response_id) + len(self.tenant) + HELD_OVERHEAD

    def encoded(self) -> bytes:
        """The record's JSON, as Redis holds it and `from_json` reads it back."""
        head = compact({"id": self.response_id, "tenant": self.tenant})[:-1]
        return b'%s,"response":%s,"conversation":%s}' % (head, self.response, self.conversation)

    @staticmethod
    def from_json(d: dict) -> "StoredResponse":
        """ValueError unless `d` is a record as `encoded` writes one."""
        rid, tenant, response, conversation = (d.get(k) for k in ("id", "tenant", "response", "conversation"))
        if not isinstance(rid, str) or not valid_id(rid):
            raise ValueError("its id is not a response id")
        if not isinstance(tenant, str) or len(tenant) > MAX_TENANT_CHARS:
            raise ValueError("its tenant is not a string of at most 256 characters")
        if not isinstance(response, dict) or response.get("id") != rid or response.get("object") != "response":
            raise ValueError("its response is not the Response object of its id")
        if not isinstance(response.get("model"), str):
            raise ValueError("its response names no model")
        if not isinstance(conversation, list):
            raise ValueError("its conversation is not a list")
        return StoredResponse.of(rid, tenant, response, tuple(Message.from_json(m) for m in conversation))
